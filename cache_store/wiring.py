"""One way to wire a Redis deployment: a fail-fast client, the KeySpace, and the page index, node registry and
page store over one guard. Used by the gateway (gateway/app.py), the backends (backend/page_store/bridge.py) and
`edgeinfer ops` (ops/commands.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgeinfer.cache_store.index import RedisPageIndex
from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.cache_store.node_auth import NodeRecordKey
from edgeinfer.cache_store.registry import RedisNodeRegistry
from edgeinfer.cache_store.resilience import RedisGuard, redis_client
from edgeinfer.cache_store.store import RedisPageStore
from edgeinfer.protocol.defaults import KEY_PREFIX


@dataclass(frozen=True)
class RedisWiring:
    client: Any                           # redis.asyncio Redis or RedisCluster (resilience.redis_client)
    keys: KeySpace
    guard: RedisGuard | None              # shared by what is built here; None: each its own default guard

    def index(self) -> RedisPageIndex:
        return RedisPageIndex(self.client, keys=self.keys, guard=self.guard)

    def registry(self, *, heartbeat_s: float = 2.0, signer: NodeRecordKey | None = None) -> RedisNodeRegistry:
        return RedisNodeRegistry(self.client, heartbeat_s=heartbeat_s, keys=self.keys, guard=self.guard,
                                 signer=signer)

    def page_store(self, *, timeout_s: float) -> RedisPageStore:
        return RedisPageStore(self.client, keys=self.keys, guard=self.guard, timeout_s=timeout_s)


def wire_redis(url: str, prefix: str = KEY_PREFIX, *, cluster: bool = False, socket_timeout_s: float | None = 1.0,
               guard_timeout_s: float | None = None) -> RedisWiring:
    """guard_timeout_s None: no shared guard (the index and registry each keep their default one)."""
    guard = RedisGuard(timeout_s=guard_timeout_s) if guard_timeout_s is not None else None
    client = redis_client(url, cluster=cluster, socket_timeout_s=socket_timeout_s)
    return RedisWiring(client, KeySpace(prefix), guard)
