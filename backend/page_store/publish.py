"""Publishing filled KV pages to the page store, off the engine's critical path.

Engine thread, on_pages_filled -> one gather of the new pages' KV into a host buffer (nothing else: no hashing,
no I/O) -> loop.call_soon_threadsafe -> publisher task: encode (keyed MAC, codec.PageKey) -> put to every tier
-> index only the pages some tier acknowledged. Bounded by max_pending_bytes: beyond it pages are dropped
(counted), never queued without limit. Pages the engine evicts are taken out of the index (unindexer task).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from edgeinfer.backend.page_store.context import StoreContext, StorePart
from edgeinfer.cache_store.codec import encode

log = logging.getLogger("edgeinfer.store_bridge")


class PagePublisher(StorePart):
    def __init__(self, ctx: StoreContext, *, max_pending_bytes: int, publish_batch_bytes: int,
                 unindex_interval_s: float) -> None:
        super().__init__(ctx)
        self.publish_batch_pages = max(1, publish_batch_bytes // self.page_bytes)
        self.max_pending_bytes = max_pending_bytes
        self.unindex_interval_s = unindex_interval_s
        self.pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._evicted: deque[bytes] = deque()       # appended on the engine thread, drained on the loop
        self._unsubscribe: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._closed = False

    def start(self) -> list[asyncio.Task]:
        """On the loop: the publisher task, and with an index the unindexer fed by the engine's evictions."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._publisher(), name="page-store-publisher")]
        if self.index is not None:
            self._unsubscribe = self.port.subscribe_evictions(self._evicted.append)
            tasks.append(asyncio.create_task(self._unindexer(), name="page-store-unindexer"))
        return tasks

    def close(self) -> None:
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    async def withdraw(self) -> None:
        """Take this node off the index entries of everything it still remembers publishing."""
        if self.index is not None and len(self.published):
            await self.index.remove_node(self.model, self.node_id, self.published.hashes())

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued page is published (or dropped); True if the queue emptied in time."""
        deadline = time.monotonic() + timeout_s
        while self.pending_bytes > 0:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    # ------------------------------------------------------------ engine thread
    def on_pages_filled(self, pages: list[tuple[bytes, int]]) -> None:
        """Engine thread: copy the new pages to host memory and hand them to the loop. Nothing else."""
        if self._loop is None or self._closed or self.store is None:
            return
        try:
            self.enqueue_from_engine(pages)
        except Exception:  # noqa: BLE001 - never break a step over publishing
            log.exception("could not queue pages for publishing")

    def enqueue_from_engine(self, pages: list[tuple[bytes, int]], again: bool = False) -> int:
        """Engine thread. again=True re-publishes pages published before (the store may have lost them)."""
        chosen = []
        dropped = 0
        for h, page in pages:
            hit = self.port.lookup(h)
            if hit is None or hit.page != page or (h in self.published and not again):
                continue
            with self._pending_lock:
                if self.pending_bytes + self.page_bytes > self.max_pending_bytes:
                    dropped += 1
                    continue
                self.pending_bytes += self.page_bytes
            chosen.append((h, hit.parent, hit.tokens, page))
        if dropped:
            assert self._loop is not None   # callers return early without a loop
            self._loop.call_soon_threadsafe(self.counters.count, "dropped", dropped)
        if not chosen:
            return 0
        try:
            buf = self.port.read_pages([c[3] for c in chosen])
            assert self._loop is not None and self._queue is not None   # both set by start()
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ([c[:3] for c in chosen], buf))
        except BaseException:
            with self._pending_lock:
                self.pending_bytes -= self.page_bytes * len(chosen)
            raise
        return len(chosen)

    # ------------------------------------------------------------ loop
    async def _publisher(self) -> None:
        assert self._queue is not None   # this task is created by start(), after the queue
        while True:
            batch = await self._queue.get()
            try:
                await self._publish(*batch)
            except Exception:  # noqa: BLE001
                self.counters.count("errors")
                log.exception("publishing pages failed")
            finally:
                with self._pending_lock:
                    self.pending_bytes -= self.page_bytes * len(batch[0])

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
                self.published.remember(h)
            self.counters.count("published", len(acked))
            self.counters.count("not_acked", len(items) - len(acked))

    async def _unindexer(self) -> None:
        while True:
            await asyncio.sleep(self.unindex_interval_s)
            try:
                await self.unindex_evicted()
            except Exception:  # noqa: BLE001 - entries left behind expire with the index TTL
                self.counters.count("errors")
                log.exception("removing evicted pages from the index failed")

    async def unindex_evicted(self) -> int:
        """Tell the index this node no longer holds the published pages its engine evicted, so the gateway
        stops routing their prefixes here. A page cached again since (recomputed, or fetched back) stays."""
        gone: list[bytes] = []
        while self._evicted:
            h = self._evicted.popleft()
            if h in self.published and self.port.lookup(h) is None:
                self.published.forget(h)
                gone.append(h)
        if gone and self.index is not None:
            await self.index.remove_node(self.model, self.node_id, gone)
            self.counters.count("unindexed", len(gone))
        return len(gone)

    async def publish_hot_pages(self, max_bytes: int | None = None, again: bool = True) -> int:
        """Queue the pages of the local prefix cache for publishing (on drain: all of them, since the store may
        have evicted or lost what was published before). Bounded by max_bytes. Returns pages queued."""
        if self.store is None or self._loop is None:
            return 0
        budget = self.max_pending_bytes if max_bytes is None else max_bytes
        candidates = await self.port.call_in_engine(
            lambda: [(h, page) for h, page in self.port.cached_pages() if again or h not in self.published])
        queued = 0
        for start in range(0, len(candidates), 64):
            room = budget // self.page_bytes - queued
            if room <= 0:
                break
            queued += await self.port.call_in_engine(self.enqueue_from_engine,
                                                     candidates[start:start + min(64, room)], again)
        return queued
