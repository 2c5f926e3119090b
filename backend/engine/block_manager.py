"""Paged KV allocator with reference counts and an in-engine prefix cache (LRU over free cached pages)."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from backend.engine.block_table import BlockTables
from backend.engine.sequence import Sequence


class CachedPage(NamedTuple):
    page: int
    parent: bytes
    tokens: tuple[int, ...]


class PrefixMatch(NamedTuple):
    pages: list[int]
    hashes: list[bytes]

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class OutOfPages(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True,
                 tables: BlockTables | None = None) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.tables = tables or BlockTables()   # mirrors every seq.block_table as it changes
        self.ref = [0] * num_pages
        self.free_uncached: list[int] = list(range(num_pages - 1, -1, -1))
        self.free_cached: OrderedDict[int, None] = OrderedDict()   # LRU: oldest first
        self.hash_of_page: dict[int, bytes] = {}
        self.cache: dict[bytes, CachedPage] = {}
        self.hits = 0
        self.queries = 0
        self.on_evict = None   # callable(hash) when a cached page is reused for other data

    # ---- accounting
    @property
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache
    def match_prefix(self, seq: Sequence, hashes: list[bytes]) -> PrefixMatch:
        pages: list[int] = []
        ids = seq.all_ids
        p = self.page_size
        parent = seq.key_ctx.root
        if self.enable_prefix_cache:
            for i, h in enumerate(hashes):
                hit = self.cache.get(h)
                if hit is None or hit.parent != parent or hit.tokens != tuple(ids[i * p:(i + 1) * p]):
                    break
                pages.append(hit.page)
                parent = h
        return PrefixMatch(pages, hashes[: len(pages)])

    def _take_free(self) -> int:
        if self.free_uncached:
            page = self.free_uncached.pop()
        elif self.free_cached:
            page, _ = self.free_cached.popitem(last=False)
            h = self.hash_of_page.pop(page)
            self.cache.pop(h, None)
            if self.on_evict is not None:
                self.on_evict(h)
        else:
            raise OutOfPages(f"Cannot allocate a page: 0 of {self.num_pages} free")
        self.ref[page] = 1
        return page

    def can_allocate(self, num_new_pages: int, reused: list[int] | tuple[int, ...] = ()) -> bool:
        reclaimed = sum(1 for pg in reused if self.ref[pg] == 0)
        return num_new_pages <= self.num_free - reclaimed

    def acquire_cached(self, pages: list[int]) -> None:
        for pg in pages:
            if self.ref[pg] == 0:
                self.free_cached.pop(pg, None)
            self.ref[pg] += 1

    def assign(self, seq: Sequence, pages: list[int]) -> None:
        """seq (holding no pages) starts with the cached `pages`, acquired here."""
        if seq.block_table:
            raise RuntimeError(f"assign: {seq.request_id} already holds {len(seq.block_table)} pages")
        self.acquire_cached(pages)
        seq.block_table = list(pages)
        self.tables.set(seq, seq.block_table)

    def allocate(self, seq: Sequence, num_pages: int) -> None:
        if num_pages > self.num_free:
            raise OutOfPages(f"Cannot allocate {num_pages} pages: {self.num_free} free")
        start = len(seq.block_table)
        for _ in range(num_pages):
            seq.block_table.append(self._take_free())
        self.tables.append(seq, start, seq.block_table[start:])

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens; False (nothing changed) if pages run out."""
        need = self.pages_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        self.allocate(seq, need)
        return True

    def register_full_pages(self, seq: Sequence, new_hashes: list[bytes]) -> list[tuple[bytes, int]]:
        """Index seq's newly filled pages in the prefix cache; returns (hash, page) pairs newly cached."""
        out: list[tuple[bytes, int]] = []
        if not self.enable_prefix_cache:
            return out
        p = self.page_size
        ids = seq.all_ids
        start = len(seq.page_hashes) - len(new_hashes)
        for j, h in enumerate(new_hashes):
            i = start + j
            page = seq.block_table[i]
            if h in self.cache or page in self.hash_of_page:
                continue
            parent = seq.page_hashes[i - 1] if i else seq.key_ctx.root
            self.cache[h] = CachedPage(page, parent, tuple(ids[i * p:(i + 1) * p]))
            self.hash_of_page[page] = h
            out.append((h, page))
        return out

    def insert_external(self, h: bytes, parent: bytes, tokens: tuple[int, ...]) -> int | None:
        """Take a free page for a page fetched from an outer tier (caller fills it); ref=1."""
        if h in self.cache or self.num_free == 0:
            return None
        page = self._take_free()
        self.cache[h] = CachedPage(page, parent, tokens)
        self.hash_of_page[page] = h
        return page

    def drop_cached(self, h: bytes) -> None:
        hit = self.cache.pop(h, None)
        if hit is not None:
            self.hash_of_page.pop(hit.page, None)
            if self.ref[hit.page] == 0:
                self.free_cached.pop(hit.page, None)
                self.free_uncached.append(hit.page)
            if self.on_evict is not None:
                self.on_evict(h)

    def free(self, seq: Sequence) -> None:
        for page in reversed(seq.block_table):
            self.release(page)
        seq.block_table = []
        self.tables.release(seq)

    def release(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] < 0:
            raise RuntimeError(f"page {page} released more often than acquired")
        if self.ref[page] == 0:
            if page in self.hash_of_page:
                self.free_cached[page] = None
            else:
                self.free_uncached.append(page)
