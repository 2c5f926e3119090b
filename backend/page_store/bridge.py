"""The backend's side of the shared prefix cache: one engine observer + server extension over three parts.

Wiring: backend.server.build_state() calls backend.page_store.wiring.attach_page_store(st, cfg), which
appends a PageStoreBridge to st.extensions and st.engine.observers. The parts:
  backend/page_store/publish.py       PagePublisher: filled pages -> host copy -> encode -> tiers -> index; evicted
                                 pages out of the index
  backend/page_store/prefetch.py      PagePrefetcher: a prompt's pages beyond the local cache -> verify -> KV pool
  backend/page_store/handoff.py       KVHandoff: prefill/decode disaggregation, pages sent node to node
  backend/page_store/registration.py  NodeRegistration: the node record, register / heartbeat / deregister
  backend/page_store/context.py       StoreContext, shared by both: StoreCounters (BridgeStats and Prometheus, one
                                 counter path) and PublishedPages
They see the engine only through its KV port (backend/engine/kv_port.py `KVPort`, `engine.kv_port`): the
prefix cache's lookup / cached_prefix_len / cached_pages / subscribe_evictions, page bodies read and written
(read_pages / write_pages, through the model's PageIO: a tensor-parallel node's span its ranks), call_in_engine,
the node's load and the page geometry.

Page body layout (PageFormat.body_nbytes == ModelRunner.page_bytes), the raw
bytes of ModelRunner.read_page(page) concatenated, i.e. for each layer l:
    K[l]  [page_size, kv_heads, head_dim]  in the kv dtype (C order)
    V[l]  [page_size, kv_heads, head_dim]
    fp8 only: K_scale[l] [page_size, kv_heads] bfloat16, then V_scale[l]
scale_layout is "none" (fp32/bf16/fp16) or "per_token_kv_head_bf16" (fp8_e4m3). An MLA model's page (kv_dtype
"mla_<dtype>", kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim) holds per layer only
    L[l]  [page_size, 1, latent_dim]  the latent rows in the kv dtype
    fp8 only: L_scale[l] [page_size, 1] bfloat16   (scale_layout "per_token_latent_bf16")
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from edgeinfer.backend.engine.kv_port import KVPort
from edgeinfer.backend.engine.observer import EngineObserver
from edgeinfer.backend.page_store.context import BridgeStats, PublishedPages, StoreContext, StoreCounters
from edgeinfer.backend.page_store.handoff import KVHandoff
from edgeinfer.backend.page_store.prefetch import PagePrefetcher
from edgeinfer.backend.page_store.publish import PagePublisher
from edgeinfer.backend.page_store.registration import NodeRegistration
from edgeinfer.cache_store.codec import PageFormat, PageKey
from edgeinfer.cache_store.index import PageIndex
from edgeinfer.cache_store.registry import NodeRegistry, NodeState
from edgeinfer.cache_store.store import TieredPageStore

log = logging.getLogger("edgeinfer.store_bridge")
__all__ = ["BridgeStats", "PageStoreBridge", "page_format"]


class HasKVPort(Protocol):
    kv_port: KVPort


def page_format(port: KVPort) -> PageFormat:
    g = port.geometry()
    return PageFormat(model_fingerprint=g.fingerprint, kv_dtype=g.kv_format, num_layers=g.num_layers,
                      kv_heads=g.kv_heads, head_dim=g.head_dim, page_size=g.page_size, scale_layout=g.scale_layout,
                      body_nbytes=g.body_bytes)


class PageStoreBridge(EngineObserver):
    """Engine observer + server extension (start/stop/before_generate/on_drain/on_undrain)."""

    def __init__(self, engine: HasKVPort, *, node_id: str, store: TieredPageStore | None, page_key: PageKey,
                 index: PageIndex | None = None,
                 registry: NodeRegistry | None = None, metrics=None, url: str = "", version: str = "",
                 state_fn: Callable[[], NodeState] | None = None, redis_client=None,
                 fetch_timeout_s: float = 1.0,
                 fetch_chunk_bytes: int = 96 << 20, max_pending_bytes: int = 256 << 20,
                 publish_batch_bytes: int = 16 << 20, published_memory: int = 1 << 16,
                 unindex_interval_s: float = 0.5, handoff_timeout_s: float = 5.0,
                 internal_secret: str | None = None, role: str = "both", handoff_peers: Sequence[str] = ()) -> None:
        self.port = port = engine.kv_port
        self.node_id = node_id
        self.store = store
        self.page_key = page_key
        self.redis_client = redis_client
        self.format = page_format(port)
        self.counters = StoreCounters(port.model_name, metrics)
        self.stats: BridgeStats = self.counters.stats
        ctx = StoreContext(port=port, store=store, index=index, page_key=page_key, format=self.format,
                           page_bytes=port.geometry().body_bytes, node_id=node_id, counters=self.counters,
                           published=PublishedPages(published_memory))
        self.publisher = PagePublisher(ctx, max_pending_bytes=max_pending_bytes, publish_batch_bytes=publish_batch_bytes,
                                       unindex_interval_s=unindex_interval_s)
        self.prefetcher = PagePrefetcher(ctx, fetch_timeout_s=fetch_timeout_s, fetch_chunk_bytes=fetch_chunk_bytes)
        self.handoff = KVHandoff(ctx, self.prefetcher, timeout_s=handoff_timeout_s, internal_secret=internal_secret,
                                 metrics=metrics, peers=handoff_peers, registry=registry)
        self.registration = None if registry is None else NodeRegistration(
            port, registry, node_id=node_id, url=url, version=version, state_fn=state_fn or (lambda: "active"),
            role=role)
        self._tasks: list[asyncio.Task] = []

    @property
    def pending_bytes(self) -> int:
        return self.publisher.pending_bytes

    # ------------------------------------------------------------ lifecycle (server extension)
    async def start(self, app=None) -> None:
        self.port.observe(self)
        if self.redis_client is not None and hasattr(self.redis_client, "initialize"):
            try:   # RedisCluster: learn the slot map now; failure is fine (the guard handles later calls)
                async with asyncio.timeout(2.0):
                    await self.redis_client.initialize()
            except Exception as e:  # noqa: BLE001
                log.warning("redis cluster not reachable at start: %s", e)
        await self.handoff.start()
        self._tasks += self.publisher.start()
        if self.registration is not None:
            self._tasks.append(await self.registration.start())

    async def stop(self, app=None) -> None:
        await self.flush(timeout_s=2.0)
        self.publisher.close()
        self.port.unobserve(self)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._tasks.clear()
        if self.registration is not None:
            await self.registration.stop()
        await self.publisher.withdraw()
        await self.handoff.stop()
        if self.redis_client is not None:
            try:
                await self.redis_client.aclose()
            except Exception:  # noqa: BLE001
                pass

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued page is published (or dropped); True if the queue emptied in time."""
        return await self.publisher.flush(timeout_s)

    async def on_drain(self, app=None) -> None:
        if self.registration is not None:
            await self.registration.heartbeat()
        n = await self.publish_hot_pages()
        await self.flush(timeout_s=5.0)
        log.info("drain: published %d hot pages", n)

    async def on_undrain(self, app=None) -> None:
        if self.registration is not None:
            await self.registration.heartbeat()

    # ------------------------------------------------------------ publish / fetch
    def on_pages_filled(self, seq, pages: list[tuple[bytes, int]]) -> None:
        self.publisher.on_pages_filled(pages)

    async def publish_hot_pages(self, max_bytes: int | None = None, again: bool = True) -> int:
        return await self.publisher.publish_hot_pages(max_bytes, again)

    async def unindex_evicted(self) -> int:
        return await self.publisher.unindex_evicted()

    async def before_generate(self, app, req) -> int:
        """The prompt's pages beyond the local cache: from its prefill node first (disaggregation), then the tiers.
        Returns how many pages were written into the pool."""
        got = 0
        if req.kv_source is not None:
            got = await self.handoff.receive(req) or 0
        return got + await self.prefetcher.prefetch(req)

    async def prefetch(self, req) -> int:
        return await self.prefetcher.prefetch(req)
