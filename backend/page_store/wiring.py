"""The page store wired per the backend's flags: tiers (host, Redis), the page index, the node registry
(signed records, heartbeat) and the page key; backend.server.build_state() calls attach_page_store."""

from __future__ import annotations

import logging
import os
from typing import Protocol

from edgeinfer.backend.page_store.bridge import PageStoreBridge
from edgeinfer.cache_store.codec import PageKey
from edgeinfer.cache_store.node_auth import NodeRecordKey
from edgeinfer.cache_store.store import HostPageStore, PageStore, TieredPageStore
from edgeinfer.cache_store.wiring import wire_redis
from edgeinfer.protocol.defaults import KEY_PREFIX

log = logging.getLogger("edgeinfer.store_bridge")
PAGE_KEY_ENV = "EDGEINFER_PAGE_KEY"


class StoreSettings(Protocol):
    """The backend's flags the page store reads (backend.node_config.BackendConfig has them)."""
    @property
    def page_key_file(self) -> str | None: ...
    @property
    def cache_seed(self) -> str: ...
    @property
    def store_tier(self) -> str: ...
    @property
    def redis_url(self) -> str | None: ...
    @property
    def host_store_bytes(self) -> int: ...
    @property
    def redis_cluster(self) -> bool: ...
    @property
    def redis_key_prefix(self) -> str: ...
    @property
    def internal_secret(self) -> str | None: ...
    @property
    def heartbeat(self) -> float: ...
    @property
    def store_fetch_timeout(self) -> float: ...
    @property
    def role(self) -> str: ...
    @property
    def handoff_timeout(self) -> float: ...
    @property
    def handoff_peers(self) -> list[str]: ...


def page_key_from_config(cfg: StoreSettings) -> PageKey:
    """--page-key-file, else $EDGEINFER_PAGE_KEY, else derived from --cache-seed (logged: weaker if the seed leaks)."""
    path = cfg.page_key_file
    if path:
        with open(path, "rb") as f:
            return PageKey.from_secret(f.read().strip(), origin=f"page key from {path}")
    env = os.environ.get(PAGE_KEY_ENV)
    if env:
        return PageKey.from_secret(env.encode(), origin=f"page key from ${PAGE_KEY_ENV}")
    log.warning("no page key (--page-key-file or $%s): pages are keyed by the cache seed, so anyone who knows "
                "the seed can write pages this node accepts", PAGE_KEY_ENV)
    return PageKey.from_seed(cfg.cache_seed.encode())


def attach_page_store(st, cfg: StoreSettings) -> PageStoreBridge | None:
    """Called by backend.server.build_state: add the page store extension per the CLI flags. A prefill or decode
    node (--role) always gets one: its hand-off to the other side (backend/page_store/handoff.py) needs no tier."""
    tier, url = cfg.store_tier, cfg.redis_url
    disaggregated = cfg.role != "both"
    if tier == "none" and not disaggregated:
        return None
    if tier == "redis" and not url and not disaggregated:
        log.info("page store off: --store-tier redis without --redis-url")
        return None
    tiers: list[tuple[str, PageStore]] = []
    if cfg.host_store_bytes > 0 and tier != "none":
        tiers.append(("host", HostPageStore(cfg.host_store_bytes)))
    client = index = registry = None
    if url:
        redis = wire_redis(url, cfg.redis_key_prefix or KEY_PREFIX, cluster=cfg.redis_cluster, guard_timeout_s=0.5)
        client = redis.client
        if tier == "redis":
            tiers.append(("redis", redis.page_store(timeout_s=2.0)))
        index = redis.index()
        secret = cfg.internal_secret   # None: --insecure-no-internal-auth, records unsigned
        registry = redis.registry(heartbeat_s=cfg.heartbeat,
                                  signer=NodeRecordKey(secret) if secret else None)
    if not tiers and not disaggregated:
        log.info("page store off: no tier (host store of 0 bytes and no redis tier)")
        return None
    bridge = PageStoreBridge(st.engine, node_id=st.node_id, store=TieredPageStore(tiers) if tiers else None,
                             page_key=page_key_from_config(cfg), index=index,
                             registry=registry, metrics=st.metrics, url=st.url, version=st.version,
                             state_fn=lambda: st.state, redis_client=client,
                             fetch_timeout_s=cfg.store_fetch_timeout, handoff_timeout_s=cfg.handoff_timeout,
                             internal_secret=cfg.internal_secret, role=cfg.role, handoff_peers=cfg.handoff_peers)
    st.engine.observers.append(bridge)
    st.extensions.append(bridge)
    log.info("page store on: tiers %s, index %s, node %s", [n for n, _ in tiers],
             "redis" if index is not None else "none", st.node_id)
    return bridge
