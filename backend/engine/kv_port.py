"""The engine's KV port: everything the page store (backend/page_store/) may do with an engine's KV pool and
prefix cache, as one typed surface, the part LMCache's connector and vLLM's KVConnectorBase_V1 play there.
LLMEngine implements it through EngineKVPort (`engine.kv_port`); a tensor-parallel node's engine is an LLMEngine
too, whose model's PageIO spans the node's ranks (backend/parallel/node.py), so the port does not change.

Threads: `cached_prefix_len`, `geometry`, `load`, `key_context` and `call_in_engine` from any thread (the first
is a hint there: single dict reads); everything else on the engine thread (inside `call_in_engine`, or an
observer's hook)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from edgeinfer.backend.engine.block_manager import CachedPage
from edgeinfer.protocol.page_id import PageKeyContext

if TYPE_CHECKING:
    from edgeinfer.backend.engine.observer import EngineObserver


@dataclass(frozen=True)
class PageGeometry:
    """What a page body is, as the page store's header names it (cache_store.codec.PageFormat)."""
    fingerprint: str
    kv_format: str          # KVFormat.ident
    scale_layout: str
    num_layers: int
    kv_heads: int           # of the whole page (a tensor-parallel node's: every rank's; MLA: 1)
    head_dim: int
    page_size: int
    body_bytes: int


@dataclass(frozen=True)
class NodeLoad:
    running: int
    waiting: int
    kv_usage: float          # pages in use / pages
    cache_hit_rate: float    # prompt tokens served from the prefix cache / looked up


RECEIVED_AS = {"host": "swap_in", "peer": "handoff_receive"}   # a page's source -> its kv_integrity `where`


@dataclass(frozen=True)
class ExternalPage:
    """A verified page body from the store, to be written into the pool: hash, parent, tokens, the tier it came
    from ("host" for a swap-in)."""
    hash: bytes
    parent: bytes
    tokens: tuple[int, ...]
    source: str


class KVPort(Protocol):
    model_name: str

    @property
    def prefix_cache(self) -> bool: ...
    def geometry(self) -> PageGeometry: ...
    def key_context(self, namespace: str) -> PageKeyContext: ...
    def load(self) -> NodeLoad: ...
    def cached_prefix_len(self, hashes: list[bytes], ids: list[int], root: bytes) -> int: ...
    def lookup(self, h: bytes) -> CachedPage | None: ...
    def cached_pages(self) -> list[tuple[bytes, int]]: ...
    def subscribe_evictions(self, fn: Callable[[bytes], None]) -> Callable[[], None]: ...
    def read_pages(self, pages: list[int]) -> torch.Tensor: ...
    def read_sealed(self, hashes: list[bytes]) -> tuple[list[tuple[bytes, CachedPage]], torch.Tensor | None]: ...
    def write_pages(self, pages: list[ExternalPage], buf: torch.Tensor, root: bytes) -> int: ...
    async def call_in_engine(self, fn: Callable[..., Any], *args: Any) -> Any: ...
    def observe(self, observer: EngineObserver) -> None: ...
    def unobserve(self, observer: EngineObserver) -> None: ...


class EngineKVPort:
    """KVPort over an LLMEngine."""

    def __init__(self, engine: Any) -> None:   # the LLMEngine (engine.py builds this adapter: no import back)
        self.engine = engine
        self.model_name = engine.model_name

    @property
    def prefix_cache(self) -> bool:
        return self.engine.cfg.enable_prefix_cache

    def geometry(self) -> PageGeometry:
        e = self.engine
        c = e.model.cfg
        world = e.runner.page_io.world
        return PageGeometry(fingerprint=e.fingerprint, kv_format=e.kv.ident, scale_layout=e.kv.scale_layout,
                            num_layers=c.num_layers,
                            kv_heads=c.num_kv_heads if c.mla is not None else c.num_kv_heads * world,   # a latent is whole
                            head_dim=c.head_dim, page_size=e.cfg.page_size, body_bytes=e.runner.page_bytes * world)

    def key_context(self, namespace: str) -> PageKeyContext:
        return self.engine.key_context(namespace)

    def load(self) -> NodeLoad:
        e, b = self.engine, self.engine.blocks
        return NodeLoad(running=e.num_running, waiting=e.num_waiting, kv_usage=b.num_used / max(b.num_pages, 1),
                        cache_hit_rate=b.hits / max(b.queries, 1))

    def cached_prefix_len(self, hashes: list[bytes], ids: list[int], root: bytes) -> int:
        return self.engine.blocks.cached_prefix_len(hashes, ids, root)

    def lookup(self, h: bytes) -> CachedPage | None:
        return self.engine.blocks.lookup(h)

    def cached_pages(self) -> list[tuple[bytes, int]]:
        return self.engine.blocks.cached_pages()

    def subscribe_evictions(self, fn: Callable[[bytes], None]) -> Callable[[], None]:
        return self.engine.blocks.subscribe_evictions(fn)

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        return self.engine.runner.page_io.read(pages)

    def read_sealed(self, hashes: list[bytes]) -> tuple[list[tuple[bytes, CachedPage]], torch.Tensor | None]:
        """The leading pages of a chain this pool holds sealed, and their bodies (host uint8, one row each), for a
        hand-off to another node; the run ends at the first page not held or whose parent is not the hash before
        it. With KV integrity on each page's bytes are checked against its sealed checksum first (where
        "handoff_send"): a page that changed since it was sealed leaves the cache and ends the run, so a corrupt
        page is never sent. (None, []) when the chain's first page is not held."""
        blocks = self.engine.blocks
        held: list[tuple[bytes, CachedPage]] = []
        for h in hashes:
            hit = blocks.lookup(h)
            if hit is None or (held and hit.parent != held[-1][0]):    # one chain: each page's parent the one before
                break
            held.append((h, hit))
        integrity = self.engine.integrity
        if held and integrity is not None:
            pages = [hit.page for _, hit in held]
            integrity.ledger.checks["handoff_send"] += len(pages)
            held = held[:integrity.verify(pages, [h for h, _ in held], "handoff_send")]
        if not held:
            return [], None
        return held, self.engine.runner.page_io.read([hit.page for _, hit in held])

    def write_pages(self, pages: list[ExternalPage], buf: torch.Tensor, root: bytes) -> int:
        """Verified pages into the KV pool and the prefix cache, chain order; returns how many leading ones landed.
        With KV integrity on, each page's bytes in the pool are read back against its body (kv_integrity
        `swap_in` from the host tier, `store_receive` from the others); the first that differs and those after it
        are dropped."""
        blocks = self.engine.blocks
        if pages[0].parent != root and blocks.lookup(pages[0].parent) is None:
            return 0     # the page before these was evicted meanwhile: they could never match
        taken: list[int] = []
        rows: list[int] = []
        hs: list[bytes] = []
        for r, pg in enumerate(pages):
            if blocks.lookup(pg.hash) is not None:
                continue
            page = blocks.insert_external(pg.hash, pg.parent, pg.tokens)
            if page is None:
                break
            taken.append(page)
            rows.append(r)
            hs.append(pg.hash)
        if not taken:
            return 0
        body = buf if len(rows) == len(pages) else buf[rows]
        try:
            self.engine.runner.page_io.write(taken, body)
            if self.engine.runner.mtp is not None:
                self.engine.runner.mtp.clear(taken)
        except BaseException:
            for h in hs:
                blocks.drop_cached(h)
            for page in taken:
                blocks.release(page)
            raise
        good = len(taken)
        integrity = self.engine.integrity
        if integrity is not None:
            where = [RECEIVED_AS.get(pages[r].source, "store_receive") for r in rows]
            good = integrity.received(taken, hs, body, where)
            for h in hs[good:]:
                blocks.drop_cached(h)
        for page in reversed(taken):   # deepest page least recently used: evicted first, the prefix survives
            blocks.release(page)
        return good

    async def call_in_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.engine.call_in_engine(fn, *args)

    def observe(self, observer: EngineObserver) -> None:
        if observer not in self.engine.observers:
            self.engine.observers.append(observer)

    def unobserve(self, observer: EngineObserver) -> None:
        if observer in self.engine.observers:
            self.engine.observers.remove(observer)
