"""What the page-store parts (publish, prefetch) share: the StoreContext, the counters (StoreCounters.count is
the one path that feeds both BridgeStats and Prometheus) and the hashes this node published recently."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from edgeinfer.backend.engine.kv_port import KVPort
from edgeinfer.cache_store.codec import PageFormat, PageKey
from edgeinfer.cache_store.index import PageIndex
from edgeinfer.cache_store.store import TieredPageStore

PAGE_EVENTS = ("published", "not_acked", "dropped", "uploaded", "incompatible", "unindexed")   # Prometheus labels


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


class StoreCounters:
    """Counts into `stats` and, with backend metrics, into edgeinfer_backend_page_store_pages{event} (the page
    events), edgeinfer_backend_integrity_failures{source} and the fetch-time histogram. Loop thread only."""

    def __init__(self, model: str, metrics=None) -> None:
        self.model = model
        self.stats = BridgeStats()
        self._pages = self._fetch_seconds = self._integrity = None
        if metrics is not None:
            self._pages = Counter("edgeinfer_backend_page_store_pages",
                                  "Page store events: " + ", ".join(PAGE_EVENTS),
                                  ["model", "event"], registry=metrics.registry)
            self._fetch_seconds = Histogram("edgeinfer_backend_page_store_fetch_seconds",
                                            "Time spent fetching + verifying + uploading pages before a request",
                                            ["model"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2),
                                            registry=metrics.registry)
            self._integrity = metrics.integrity_failures

    def count(self, event: str, n: int = 1, *, source: str = "") -> None:
        setattr(self.stats, event, getattr(self.stats, event) + n)
        if not n:
            return
        if self._pages is not None and event in PAGE_EVENTS:
            self._pages.labels(self.model, event).inc(n)
        if self._integrity is not None and event == "integrity_failures":
            self._integrity.labels(self.model, source).inc(n)

    def fetch_took(self, seconds: float) -> None:
        if self._fetch_seconds is not None:
            self._fetch_seconds.labels(self.model).observe(seconds)


class PublishedPages:
    """Hashes this node published (or fetched from the store) recently, oldest first, at most `memory` of them."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        return h in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def remember(self, h: bytes) -> None:
        self._hashes[h] = None
        self._hashes.move_to_end(h)
        while len(self._hashes) > self.memory:
            self._hashes.popitem(last=False)

    def forget(self, h: bytes) -> None:
        self._hashes.pop(h, None)

    def hashes(self) -> list[bytes]:
        return list(self._hashes)


@dataclass(frozen=True)
class StoreContext:
    port: KVPort                    # the engine's KV, as the page store may use it
    store: TieredPageStore | None
    index: PageIndex | None
    page_key: PageKey
    format: PageFormat
    page_bytes: int                 # == format.body_nbytes == ModelRunner.page_bytes
    node_id: str
    counters: StoreCounters
    published: PublishedPages

    @property
    def model(self) -> str:
        return self.counters.model


class StorePart:
    """Publisher and prefetcher: the context's fields as their own."""

    def __init__(self, ctx: StoreContext) -> None:
        self.port = ctx.port
        self.store = ctx.store
        self.index = ctx.index
        self.page_key = ctx.page_key
        self.format = ctx.format
        self.page_bytes = ctx.page_bytes
        self.node_id = ctx.node_id
        self.model = ctx.model
        self.counters = ctx.counters
        self.published = ctx.published
