"""Backend node registry: who serves which model, in what state, under what load.

`<prefix>:node:<node_id>` -> msgspec JSON NodeRecord, TTL = 3 heartbeats, so a
node that stops heartbeating disappears by itself. Every heartbeat writes the whole record and the
set membership (not just a TTL), so a Redis that restarted empty holds the node again after its next
beat; `keep_registered` drives the beats (sooner after one that did not land). `<prefix>:nodes` is the set
of registered ids (no SCAN: on a cluster SCAN is per node). Listing reads the
set, then GETs each record in one pipeline; single-key commands only, so the
record keys may sit on any cluster slot. Ids whose record expired are pruned
from the set lazily.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from collections.abc import Callable

import msgspec

from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.cache_store.node_auth import NodeRecordKey
from edgeinfer.cache_store.node_record import NodeRecord, NodeState
from edgeinfer.cache_store.resilience import RedisGuard

__all__ = ["NodeRecord", "NodeRecordKey", "NodeRegistry", "NodeState"]
log = logging.getLogger(__name__)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(NodeRecord)


class NodeRegistry(abc.ABC):
    """Invariants: a record is visible for at most 3 heartbeat intervals after its last heartbeat;
    list_nodes never raises for an unreachable store."""

    heartbeat_s: float

    @abc.abstractmethod
    async def register(self, record: NodeRecord) -> bool: ...

    @abc.abstractmethod
    async def heartbeat(self, record: NodeRecord) -> bool: ...

    @abc.abstractmethod
    async def deregister(self, node_id: str) -> bool: ...

    @abc.abstractmethod
    async def list_nodes(self, model: str | None = None) -> list[NodeRecord]: ...

    @property
    def ttl_s(self) -> float:
        return self.heartbeat_s * 3


def _stamped(record: NodeRecord) -> NodeRecord:
    return msgspec.structs.replace(record, updated_at=time.time())


class RedisNodeRegistry(NodeRegistry):
    """When Redis is unreachable, list_nodes returns the last listing it got (stale but usable)."""

    def __init__(self, client, *, heartbeat_s: float = 2.0, keys: KeySpace | None = None,
                 guard: RedisGuard | None = None, signer: NodeRecordKey | None = None) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, got {heartbeat_s}")
        self.client = client
        self.heartbeat_s = heartbeat_s
        self.keys = keys or KeySpace()
        self.guard = guard or RedisGuard()
        self.signer = signer  # signs every record this node writes (None: unsigned, no internal secret)
        self.round_trips = 0
        self._last_listing: list[NodeRecord] = []

    async def _execute(self, fill) -> list:
        self.round_trips += 1
        pipe = self.client.pipeline(transaction=False)
        fill(pipe)
        return await pipe.execute(raise_on_error=False)

    async def heartbeat(self, record: NodeRecord) -> bool:
        stamped = _stamped(record)
        if self.signer is not None:
            stamped = self.signer.sign(stamped, self.ttl_s)
        blob = _encoder.encode(stamped)
        ttl_ms = max(1, int(self.ttl_s * 1000))

        def fill(pipe) -> None:
            pipe.set(self.keys.node(record.node_id), blob, px=ttl_ms)
            pipe.sadd(self.keys.nodes, record.node_id.encode())

        # forced through an open breaker: the beat is what puts the node back into a restarted Redis
        results = await self.guard.run(lambda: self._execute(fill), None, "node heartbeat", force=True)
        return results is not None and results[0] is True

    async def register(self, record: NodeRecord) -> bool:
        return await self.heartbeat(record)

    async def deregister(self, node_id: str) -> bool:
        def fill(pipe) -> None:
            pipe.execute_command("DEL", self.keys.node(node_id))
            pipe.srem(self.keys.nodes, node_id.encode())

        results = await self.guard.run(lambda: self._execute(fill), None, "node deregister")
        return results is not None and not any(isinstance(r, Exception) for r in results)

    async def list_nodes(self, model: str | None = None) -> list[NodeRecord]:
        async def fetch() -> list[NodeRecord]:
            self.round_trips += 1
            ids = sorted(m.decode() for m in await self.client.smembers(self.keys.nodes))
            if not ids:
                return []
            blobs = await self._execute(lambda pipe: [pipe.get(self.keys.node(i)) for i in ids])
            records, gone = [], []
            for node_id, blob in zip(ids, blobs, strict=True):
                if isinstance(blob, bytes):
                    try:
                        records.append(_decoder.decode(blob))
                        continue
                    except msgspec.MsgspecError:
                        pass
                if blob is None:
                    gone.append(node_id.encode())
            if gone:
                self.round_trips += 1
                await self.client.srem(self.keys.nodes, *gone)
            return records

        records = await self.guard.run(fetch, None, "node list")
        if records is None:
            records = self._last_listing
        else:
            self._last_listing = records
        return [r for r in records if model is None or r.model == model]


class InMemoryNodeRegistry(NodeRegistry):
    def __init__(self, *, heartbeat_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_s = heartbeat_s
        self._clock = clock
        self._records: dict[str, tuple[NodeRecord, float]] = {}
        self._lock = threading.Lock()

    async def heartbeat(self, record: NodeRecord) -> bool:
        with self._lock:
            self._records[record.node_id] = (_stamped(record), self._clock() + self.ttl_s)
        return True

    async def register(self, record: NodeRecord) -> bool:
        return await self.heartbeat(record)

    async def deregister(self, node_id: str) -> bool:
        with self._lock:
            self._records.pop(node_id, None)
        return True

    async def list_nodes(self, model: str | None = None) -> list[NodeRecord]:
        with self._lock:
            now = self._clock()
            for node_id in [n for n, (_, exp) in self._records.items() if exp <= now]:
                del self._records[node_id]
            return [r for n, (r, _) in sorted(self._records.items()) if model is None or r.model == model]


async def keep_registered(registry: NodeRegistry, record: Callable[[], NodeRecord], *, landed: bool = True) -> None:
    """Heartbeat `record()` forever: every heartbeat_s, or every heartbeat_s / 4 while beats do not land
    (Redis down or restarting), so a node is listed again within a quarter beat of Redis coming back.
    `landed`: whether the registration just before this loop reached the store."""
    while True:
        await asyncio.sleep(registry.heartbeat_s if landed else registry.heartbeat_s / 4)
        try:
            landed = await registry.heartbeat(record())
        except Exception:  # noqa: BLE001 - a bad record must not end the beats
            log.exception("node heartbeat failed")
            landed = False
