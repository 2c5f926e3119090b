"""The backend's side of the shared prefix cache: publish filled KV pages, fetch + verify + upload missing ones.

Wiring: backend.server.build_state() calls backend.store_wiring.attach_page_store(st, args), which
appends a PageStoreBridge to st.extensions and st.engine.observers. The page body's bytes are moved in and
out of the KV pool by backend.engine.kv_pool.gather_pages / scatter_pages.

Publish (off the critical path):
  engine thread, on_pages_filled -> one gather of the new pages' KV into a host
  buffer (nothing else: no hashing, no I/O) -> loop.call_soon_threadsafe ->
  publisher task: encode (keyed MAC, codec.PageKey) -> put to every tier -> index only the
  pages some tier acknowledged. Bounded by max_pending_bytes: beyond it pages
  are dropped (counted), never queued without limit.

Fetch (before_generate, awaited before the request reaches the engine):
  prompt page hashes -> leading pages already in the local prefix cache ->
  the following pages from the tiers, nearest first (host, then Redis: one
  pipeline per chunk of fetch_chunk_bytes) -> codec.decode each (MAC under the page key) against
  what this engine expects (hash, parent, tokens, format) -> stop at the first miss.
  An integrity failure is counted (integrity_failures{model,source}), logged
  with the page hash and tier, deleted from that tier, and ends the fetch (the
  rest is recomputed). Verified pages go into the KV pool on the engine
  thread (insert_external + write + release), so the scheduler's own prefix
  match then hits them. Bounded by fetch_timeout_s; never fails the request.

Page body layout (PageFormat.body_nbytes == ModelRunner.page_bytes), the raw
bytes of ModelRunner.read_page(page) concatenated, i.e. for each layer l:
    K[l]  [page_size, kv_heads, head_dim]  in the kv dtype (C order)
    V[l]  [page_size, kv_heads, head_dim]
    fp8 only: K_scale[l] [page_size, kv_heads] bfloat16, then V_scale[l]
scale_layout is "none" (fp32/bf16/fp16) or "per_token_kv_head_bf16" (fp8_e4m3).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from backend.engine.engine import EngineObserver
from backend.engine.kv_pool import gather_pages, scatter_pages
from cache_store.codec import DecodedPage, PageFormat, PageKey, decode, encode
from cache_store.index import PageIndex
from cache_store.registry import NodeRecord, NodeRegistry, NodeState, keep_registered
from cache_store.store import TieredPageStore
from protocol.page_id import page_hashes

log = logging.getLogger("edgeinfer.store_bridge")


def page_format(engine) -> PageFormat:
    c = engine.model.cfg
    return PageFormat(model_fingerprint=engine.fingerprint, kv_dtype=engine.kv.name, num_layers=c.num_layers,
                      kv_heads=c.num_kv_heads, head_dim=c.head_dim, page_size=engine.cfg.page_size,
                      scale_layout=engine.kv.scale_layout,
                      body_nbytes=engine.runner.page_bytes)


@dataclass
class BridgeStats:
    published: int = 0          # pages acknowledged by at least one tier (and then indexed)
    not_acked: int = 0          # pages no tier acknowledged (not indexed)
    dropped: int = 0            # pages not published: the pending queue was full
    fetch_requests: int = 0     # requests that looked beyond the local cache
    fetch_hit_requests: int = 0
    uploaded: int = 0           # verified pages written into the KV pool
    integrity_failures: int = 0
    incompatible: int = 0       # well-formed pages this engine cannot use (left in the store)
    fetch_timeouts: int = 0
    unindexed: int = 0          # published pages this node evicted, removed from the index
    errors: int = 0


class PageStoreBridge(EngineObserver):
    """Engine observer + server extension (start/stop/before_generate/on_drain/on_undrain)."""

    def __init__(self, engine, *, node_id: str, store: TieredPageStore | None, page_key: PageKey,
                 index: PageIndex | None = None,
                 registry: NodeRegistry | None = None, metrics=None, url: str = "", version: str = "",
                 state_fn: Callable[[], NodeState] | None = None, redis_client=None,
                 fetch_timeout_s: float = 1.0,
                 fetch_chunk_bytes: int = 96 << 20, max_pending_bytes: int = 256 << 20,
                 publish_batch_bytes: int = 16 << 20, published_memory: int = 1 << 16,
                 unindex_interval_s: float = 0.5) -> None:
        self.engine = engine
        self.node_id = node_id
        self.store = store
        self.page_key = page_key
        self.index = index
        self.registry = registry
        self.metrics = metrics
        self.url = url
        self.version = version
        self.state_fn: Callable[[], NodeState] = state_fn or (lambda: "active")
        self.redis_client = redis_client
        self.fetch_timeout_s = fetch_timeout_s
        self.format = page_format(engine)
        self.page_bytes = engine.runner.page_bytes
        self.fetch_chunk_pages = max(1, fetch_chunk_bytes // self.page_bytes)
        self.publish_batch_pages = max(1, publish_batch_bytes // self.page_bytes)
        self.max_pending_bytes = max_pending_bytes
        self.stats = BridgeStats()
        self.model = engine.model_name
        self.started_at = time.time()
        self._published: OrderedDict[bytes, None] = OrderedDict()   # recently published hashes (bounded)
        self._published_memory = published_memory
        self._evicted: deque[bytes] = deque()       # appended on the engine thread, drained on the loop
        self.unindex_interval_s = unindex_interval_s
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._closed = False
        self._pages_counter = self._fetch_hist = None
        if metrics is not None:
            from prometheus_client import Counter, Histogram

            self._pages_counter = Counter("edgeinfer_backend_page_store_pages",
                                          "Page store events: published, not_acked, dropped, uploaded, incompatible, unindexed",
                                          ["model", "event"], registry=metrics.registry)
            self._fetch_hist = Histogram("edgeinfer_backend_page_store_fetch_seconds",
                                         "Time spent fetching + verifying + uploading pages before a request",
                                         ["model"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2),
                                         registry=metrics.registry)

    # ------------------------------------------------------------ helpers
    def _count(self, event: str, n: int = 1) -> None:
        setattr(self.stats, event, getattr(self.stats, event) + n)
        if self._pages_counter is not None and n:
            self._pages_counter.labels(self.model, event).inc(n)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    # ------------------------------------------------------------ lifecycle (server extension)
    async def start(self, app=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        if self not in self.engine.observers:
            self.engine.observers.append(self)
        if self.redis_client is not None and hasattr(self.redis_client, "initialize"):
            try:   # RedisCluster: learn the slot map now; failure is fine (the guard handles later calls)
                async with asyncio.timeout(2.0):
                    await self.redis_client.initialize()
            except Exception as e:  # noqa: BLE001
                log.warning("redis cluster not reachable at start: %s", e)
        self._tasks.append(asyncio.create_task(self._publisher(), name="page-store-publisher"))
        if self.index is not None:
            self.engine.blocks.on_evict = self._evicted.append
            self._tasks.append(asyncio.create_task(self._unindexer(), name="page-store-unindexer"))
        if self.registry is not None:
            landed = await self.registry.register(self.record())
            self._tasks.append(asyncio.create_task(keep_registered(self.registry, self.record, landed=landed),
                                                   name="page-store-heartbeat"))

    async def stop(self, app=None) -> None:
        await self.flush(timeout_s=2.0)
        self._closed = True
        if self in self.engine.observers:
            self.engine.observers.remove(self)
        if self.engine.blocks.on_evict == self._evicted.append:
            self.engine.blocks.on_evict = None
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._tasks.clear()
        if self.registry is not None:
            await self.registry.deregister(self.node_id)
        if self.index is not None and self._published:
            await self.index.remove_node(self.model, self.node_id, list(self._published))
        if self.redis_client is not None:
            try:
                await self.redis_client.aclose()
            except Exception:  # noqa: BLE001
                pass

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued page is published (or dropped); True if the queue emptied in time."""
        deadline = time.monotonic() + timeout_s
        while self._pending_bytes > 0:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    # ------------------------------------------------------------ registry
    def record(self) -> NodeRecord:
        e = self.engine
        b = e.blocks
        return NodeRecord(node_id=self.node_id, url=self.url, model=self.model, version=self.version,
                          state=self.state_fn(), running=e.num_running, waiting=e.num_waiting,
                          kv_usage=b.num_used / max(b.num_pages, 1), cache_hit_rate=b.hits / max(b.queries, 1),
                          started_at=self.started_at)

    async def on_drain(self, app=None) -> None:
        if self.registry is not None:
            await self.registry.heartbeat(self.record())
        n = await self.publish_hot_pages()
        await self.flush(timeout_s=5.0)
        log.info("drain: published %d hot pages", n)

    async def on_undrain(self, app=None) -> None:
        if self.registry is not None:
            await self.registry.heartbeat(self.record())

    # ------------------------------------------------------------ publish
    def on_pages_filled(self, seq, pages: list[tuple[bytes, int]]) -> None:
        """Engine thread: copy the new pages to host memory and hand them to the loop. Nothing else."""
        if self._loop is None or self._closed or self.store is None:
            return
        try:
            self._enqueue_from_engine(pages)
        except Exception:  # noqa: BLE001 - never break a step over publishing
            log.exception("could not queue pages for publishing")

    def _enqueue_from_engine(self, pages: list[tuple[bytes, int]], again: bool = False) -> int:
        """Engine thread. again=True re-publishes pages published before (the store may have lost them)."""
        cache = self.engine.blocks.cache
        chosen = []
        dropped = 0
        for h, page in pages:
            hit = cache.get(h)
            if hit is None or hit.page != page or (h in self._published and not again):
                continue
            with self._pending_lock:
                if self._pending_bytes + self.page_bytes > self.max_pending_bytes:
                    dropped += 1
                    continue
                self._pending_bytes += self.page_bytes
            chosen.append((h, hit.parent, hit.tokens, page))
        if dropped:
            assert self._loop is not None   # callers return early without a loop
            self._loop.call_soon_threadsafe(self._count, "dropped", dropped)
        if not chosen:
            return 0
        try:
            buf = gather_pages(self.engine.runner, [c[3] for c in chosen])
            assert self._loop is not None and self._queue is not None   # both set by start()
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ([c[:3] for c in chosen], buf))
        except BaseException:
            with self._pending_lock:
                self._pending_bytes -= self.page_bytes * len(chosen)
            raise
        return len(chosen)

    async def _publisher(self) -> None:
        assert self._queue is not None   # this task is created by start(), after the queue
        while True:
            batch = await self._queue.get()
            try:
                await self._publish(*batch)
            except Exception:  # noqa: BLE001
                self.stats.errors += 1
                log.exception("publishing pages failed")
            finally:
                with self._pending_lock:
                    self._pending_bytes -= self.page_bytes * len(batch[0])

    async def _publish(self, meta: list[tuple[bytes, bytes, tuple]], buf: torch.Tensor) -> None:
        rows = buf.numpy()
        fmt = self.format
        for start in range(0, len(meta), self.publish_batch_pages):
            chunk = meta[start:start + self.publish_batch_pages]
            items = [(h, encode(fmt.header(h, parent, tokens), rows[start + j], self.page_key))
                     for j, (h, parent, tokens) in enumerate(chunk)]
            assert self.store is not None   # pages are queued only with a store (on_pages_filled)
            acks = await self.store.put_many(items)
            acked = [h for (h, _), ok in zip(items, acks, strict=True) if ok]
            if acked and self.index is not None:
                await self.index.publish(self.model, self.node_id, acked)
            for h in acked:
                self._remember(h)
            self._count("published", len(acked))
            self._count("not_acked", len(items) - len(acked))

    async def _unindexer(self) -> None:
        while True:
            await asyncio.sleep(self.unindex_interval_s)
            try:
                await self.unindex_evicted()
            except Exception:  # noqa: BLE001 - entries left behind expire with the index TTL
                self.stats.errors += 1
                log.exception("removing evicted pages from the index failed")

    async def unindex_evicted(self) -> int:
        """Tell the index this node no longer holds the published pages its engine evicted, so the gateway
        stops routing their prefixes here. A page cached again since (recomputed, or fetched back) stays."""
        cache = self.engine.blocks.cache
        gone: list[bytes] = []
        while self._evicted:
            h = self._evicted.popleft()
            if h in self._published and h not in cache:
                del self._published[h]
                gone.append(h)
        if gone and self.index is not None:
            await self.index.remove_node(self.model, self.node_id, gone)
            self._count("unindexed", len(gone))
        return len(gone)

    def _remember(self, h: bytes) -> None:
        self._published[h] = None
        self._published.move_to_end(h)
        while len(self._published) > self._published_memory:
            self._published.popitem(last=False)

    async def publish_hot_pages(self, max_bytes: int | None = None, again: bool = True) -> int:
        """Queue the pages of the local prefix cache for publishing (on drain: all of them, since the store may
        have evicted or lost what was published before). Bounded by max_bytes. Returns pages queued."""
        if self.store is None or self._loop is None:
            return 0
        budget = self.max_pending_bytes if max_bytes is None else max_bytes
        candidates = await self.engine.call_in_engine(
            lambda: [(h, c.page) for h, c in list(self.engine.blocks.cache.items())
                     if again or h not in self._published])
        queued = 0
        for start in range(0, len(candidates), 64):
            room = budget // self.page_bytes - queued
            if room <= 0:
                break
            queued += await self.engine.call_in_engine(self._enqueue_from_engine,
                                                       candidates[start:start + min(64, room)], again)
        return queued

    # ------------------------------------------------------------ fetch
    async def before_generate(self, app, req) -> None:
        await self.prefetch(req)

    def _local_prefix(self, hashes: list[bytes], tokens: list[int], root: bytes) -> int:
        """Leading pages already in the engine's prefix cache. Read from the loop thread: single dict.get calls
        on immutable entries (atomic under the GIL), so it is a hint; the engine-thread upload re-checks the chain.
        """
        cache = self.engine.blocks.cache
        p = self.format.page_size
        parent = root
        for i, h in enumerate(hashes):
            hit = cache.get(h)
            if hit is None or hit.parent != parent or hit.tokens != tuple(tokens[i * p:(i + 1) * p]):
                return i
            parent = h
        return len(hashes)

    async def prefetch(self, req) -> int:
        """Fetch, verify and upload the prompt's pages beyond the local cache. Returns pages uploaded."""
        if self.store is None or not self.engine.cfg.enable_prefix_cache or (req.tenant and not req.tenant.retain):
            return 0    # a no-retain tenant's prompts neither fetch nor (through the fetch) index anything
        t0 = time.monotonic()
        try:
            return await self._prefetch(req, t0 + self.fetch_timeout_s)
        except Exception:  # noqa: BLE001 - the store never fails a request
            self.stats.errors += 1
            log.exception("page fetch failed for request %s; computing it instead", req.request_id)
            return 0
        finally:
            if self._fetch_hist is not None:
                self._fetch_hist.labels(self.model).observe(time.monotonic() - t0)

    async def _prefetch(self, req, deadline: float) -> int:
        ctx = self.engine.key_context(req.cache_namespace)
        tokens = req.prompt_token_ids
        p = ctx.page_size
        usable = (len(tokens) - 1) // p      # the scheduler always computes >= 1 prompt token
        if usable <= 0:
            return 0
        root = ctx.root
        hashes = page_hashes(ctx, tokens[: usable * p])
        first = self._local_prefix(hashes, tokens, root)
        if first >= usable:
            return 0
        self.stats.fetch_requests += 1
        uploads: list[asyncio.Future] = []
        i = first
        done = False
        while i < usable and not done:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stats.fetch_timeouts += 1
                break
            keys = hashes[i:min(usable, i + self.fetch_chunk_pages)]
            assert self.store is not None   # checked by prefetch()
            sourced = await self.store.get_many_sourced(keys, timeout_s=left)
            good: list[tuple[bytes, bytes, tuple]] = []
            bodies: list[memoryview] = []
            for j, got in enumerate(sourced):
                k = i + j
                h = hashes[k]
                if got is None:
                    done = True
                    break
                blob, source = got
                parent = hashes[k - 1] if k else root
                page_tokens = tokens[k * p:(k + 1) * p]
                res = decode(blob, self.format.expect(h, parent, page_tokens), self.page_key)
                if not isinstance(res, DecodedPage):
                    self._published.pop(h, None)   # the store's copy is not ours: publish ours again once computed
                    if res.integrity_failure:
                        await self._integrity_failure(h, source, res)
                    else:
                        self._count("incompatible")
                        log.info("page %s from the %s tier is not usable here: %s (%s)", h.hex(), source,
                                 res.reason.label, res.detail)
                    done = True
                    break
                good.append((h, parent, tuple(page_tokens)))
                bodies.append(res.body)
            if good:
                buf = np.empty((len(good), self.page_bytes), dtype=np.uint8)
                for r, body in enumerate(bodies):
                    buf[r] = np.frombuffer(body, dtype=np.uint8)
                fut = asyncio.ensure_future(self.engine.call_in_engine(self._upload, good, torch.from_numpy(buf),
                                                                       root))
                await asyncio.sleep(0)        # lets the task queue its engine command now, in chain order
                uploads.append(fut)
            i += len(keys)
            if len(good) < len(keys):
                done = True
        uploaded = 0
        if uploads:
            left = max(deadline - time.monotonic(), 0.05)
            try:
                async with asyncio.timeout(left):
                    for n in await asyncio.gather(*uploads):
                        uploaded += n
            except TimeoutError:
                # the uploads are queued ahead of this request's admission, so they still land first
                self.stats.fetch_timeouts += 1
        if uploaded:
            self.stats.fetch_hit_requests += 1
            self._count("uploaded", uploaded)
            held = hashes[first:first + uploaded]
            for h in held:                 # already in the store: a drain need not publish them again
                self._remember(h)
            if self.index is not None:     # this node now holds them too (background; a hint for routing)
                task = asyncio.create_task(self.index.publish(self.model, self.node_id, held))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        return uploaded

    async def _integrity_failure(self, h: bytes, source: str, miss) -> None:
        self.stats.integrity_failures += 1
        if self.metrics is not None:
            self.metrics.integrity_failures.labels(self.model, source).inc()
        log.warning("integrity failure: page %s from the %s tier: %s (%s); deleted from %s, recomputing",
                    h.hex(), source, miss.reason.label, miss.detail, source)
        try:
            assert self.store is not None   # pages are fetched only with a store
            await self.store.delete_from(source, [h])
        except Exception:  # noqa: BLE001
            log.exception("could not delete corrupt page %s from %s", h.hex(), source)

    def _upload(self, pages: list[tuple[bytes, bytes, tuple]], buf: torch.Tensor, root: bytes) -> int:
        """Engine thread: put verified pages into the KV pool and the prefix cache, chain order; returns count."""
        blocks = self.engine.blocks
        first_parent = pages[0][1]
        if first_parent != root and first_parent not in blocks.cache:
            return 0     # the page before these was evicted meanwhile: they could never match
        taken: list[int] = []
        rows: list[int] = []
        hs: list[bytes] = []
        for r, (h, parent, toks) in enumerate(pages):
            if h in blocks.cache:
                continue
            page = blocks.insert_external(h, parent, toks)
            if page is None:
                break
            taken.append(page)
            rows.append(r)
            hs.append(h)
        if not taken:
            return 0
        try:
            scatter_pages(self.engine.runner, taken, buf if len(rows) == len(pages) else buf[rows])
        except BaseException:
            for h in hs:
                blocks.drop_cached(h)
            for page in taken:
                blocks.release(page)
            raise
        for page in reversed(taken):   # deepest page least recently used: evicted first, the prefix survives
            blocks.release(page)
        return len(taken)
