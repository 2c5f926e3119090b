"""Paged KV allocator with reference counts and an in-engine prefix cache over free cached pages.

Eviction of free cached pages: "lru" takes the least recently freed page; "fair" (per-tenant quota) takes the
least recently freed page of the tenant most over its share, i.e. with the most cached pages per unit of
weight (TenantSpec.weight), counting the pages it has cached whether in use or free. A page belongs to the
tenant whose sequence filled it; a page fetched from an outer tier (insert_external) to the first tenant that
uses it. A tenant with retain=False never gets a page into the cache: its pages are freed uncached.

Every page carries an identity in `ledger` (backend/engine/page_ledger.py, checked as kv_integrity.py says): a stamp drawn each time it is taken
or freed uncached, its owner, and once sealed its checksum. A sequence records the stamp of each page it takes
(seq.page_stamps, mirrored in `tables`), a prefix-cache entry the stamp its page had when sealed. A prefix hit
takes only pages whose entry still names them (and, with `verify_content`, whose bytes still have their sealed
checksum); a sequence gives back only pages it still holds.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from edgeinfer.backend.engine.block_table import BlockTables
from edgeinfer.backend.engine.page_ledger import EXTERNAL, PageLedger
from edgeinfer.backend.engine.sequence import Sequence


class CachedPage(NamedTuple):
    page: int
    parent: bytes
    tokens: tuple[int, ...]
    stamp: int = 0              # the page's stamp when it was sealed (ledger.stamp while the entry is true)


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
                 tables: BlockTables | None = None, eviction: str = "fair") -> None:
        if eviction not in ("fair", "lru"):
            raise ValueError(f"eviction={eviction!r} is invalid: expected fair or lru")
        self.eviction = eviction
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.tables = tables or BlockTables()   # mirrors every seq.block_table as it changes
        self.ref = [0] * num_pages
        self.free_uncached: list[int] = list(range(num_pages - 1, -1, -1))
        self.free_cached: OrderedDict[int, None] = OrderedDict()   # LRU: oldest first
        self.free_cached_of: dict[str, OrderedDict[int, None]] = {}   # the same pages by owner, LRU each
        self.owner: dict[int, str] = {}        # cached page -> tenant id ("" until a tenant uses an external page)
        self.held: Counter[str] = Counter()    # cached pages (in use or free) per tenant
        self.weights: dict[str, float] = {}    # tenant id -> weight, as last seen
        self.hash_of_page: dict[int, bytes] = {}
        self.cache: dict[bytes, CachedPage] = {}
        self.hits = 0
        self.queries = 0
        self._evict_subscribers: list[Callable[[bytes], None]] = []   # told the hash of every page leaving the cache
        self.ledger = PageLedger(num_pages)
        self.check_identity = True             # prefix hits and frees check page identity (EngineConfig.kv_integrity)
        # set by the engine: (pages, hashes, where) -> how many leading pages keep their sealed checksum
        self.verify_content: Callable[[list[int], list[bytes], str], int] | None = None

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
        """seq's leading pages in the prefix cache whose entries still name them (verify_taken checks content)."""
        # a request for its prompt's logprobs computes every prompt position (a hit would skip their logits): the
        # same logprobs as a cold prefill, whatever the cache holds (as vLLM does)
        wants_logits = seq.prompt_lps is not None
        n = self.cached_prefix_len(hashes, seq.all_ids, seq.key_ctx.root) \
            if self.enable_prefix_cache and not wants_logits else 0
        if not self.check_identity:
            return PrefixMatch([self.cache[h].page for h in hashes[:n]], hashes[:n])
        where = self._hit_where(seq)
        pages: list[int] = []
        for h in hashes[:n]:
            entry = self.cache[h]
            self.ledger.checks[where] += 1
            if self.ledger.stamp[entry.page] != entry.stamp or self.hash_of_page.get(entry.page) != h:
                self._drop_stale(h, entry, where)
                break
            pages.append(entry.page)
        return PrefixMatch(pages, hashes[:len(pages)])

    def verify_taken(self, seq: Sequence, pages: list[int], hashes: list[bytes]) -> bool:
        """The content check of prefix-hit pages seq is about to take (after match_prefix, once they fit): False if
        one changed since it was sealed (it is dropped from the cache: match again)."""
        if not pages or self.verify_content is None or not self.check_identity:
            return True
        return self.verify_content(pages, hashes, self._hit_where(seq)) == len(pages)

    @staticmethod
    def _hit_where(seq: Sequence) -> str:
        """The integrity label of seq taking cached pages: its first admission, or a resume after preemption."""
        return "resume" if seq.admitted_once else "prefix_hit"

    def _drop_stale(self, h: bytes, entry: CachedPage, where: str) -> None:
        """A prefix-cache entry whose page was freed or taken since it was sealed: out of the cache (the page's
        present identity, if any, is left alone)."""
        self.ledger.fail(where, f"prefix entry {h.hex()[:16]} names page {entry.page} with stamp {entry.stamp}; the "
                                f"page has stamp {int(self.ledger.stamp[entry.page])}")
        if self.hash_of_page.get(entry.page) == h:
            self.drop_cached(h)
        else:
            self.cache.pop(h, None)
            self._evicted(h)

    def cached_prefix_len(self, hashes: list[bytes], ids: list[int], root: bytes) -> int:
        """Leading pages of `hashes` cached here, each with its parent and tokens compared. Safe to call from
        another thread as a hint: single dict.get calls on immutable entries (atomic under the GIL)."""
        p = self.page_size
        parent = root
        for i, h in enumerate(hashes):
            hit = self.cache.get(h)
            if hit is None or hit.parent != parent or hit.tokens != tuple(ids[i * p:(i + 1) * p]):
                return i
            parent = h
        return len(hashes)

    # ---- the page store's view (backend/page_store/): lookup, insert_external, evictions
    def lookup(self, h: bytes) -> CachedPage | None:
        return self.cache.get(h)

    def cached_pages(self) -> list[tuple[bytes, int]]:
        """(hash, page) of every cached page (engine thread)."""
        return [(h, c.page) for h, c in list(self.cache.items())]

    def subscribe_evictions(self, fn: Callable[[bytes], None]) -> Callable[[], None]:
        """fn(hash) is called (engine thread) for each page that leaves the prefix cache; returns the unsubscribe."""
        self._evict_subscribers.append(fn)

        def unsubscribe() -> None:
            if fn in self._evict_subscribers:
                self._evict_subscribers.remove(fn)
        return unsubscribe

    def _evicted(self, h: bytes) -> None:
        for fn in self._evict_subscribers:
            fn(h)

    # ---- cached page bookkeeping
    def _cache_page(self, page: int, h: bytes, entry: CachedPage, owner: str) -> None:
        self.cache[h] = entry
        self.hash_of_page[page] = h
        self.owner[page] = owner
        self.held[owner] += 1

    def _uncache_page(self, page: int) -> bytes:
        h = self.hash_of_page.pop(page)
        self.cache.pop(h, None)
        owner = self.owner.pop(page)
        self.held[owner] -= 1
        if not self.held[owner]:
            del self.held[owner]
        return h

    def _park(self, page: int) -> None:
        """A cached page nobody references: evictable."""
        self.free_cached[page] = None
        self.free_cached_of.setdefault(self.owner[page], OrderedDict())[page] = None

    def _unpark(self, page: int) -> None:
        self.free_cached.pop(page, None)
        owner = self.owner.get(page)
        mine = None if owner is None else self.free_cached_of.get(owner)
        if owner is not None and mine is not None:
            mine.pop(page, None)
            if not mine:
                del self.free_cached_of[owner]

    def over_share(self, tenant: str) -> float:
        """Cached pages per unit of weight: eviction under "fair" starts with the largest."""
        return self.held[tenant] / self.weights.get(tenant, 1.0)

    def eviction_candidate(self) -> int | None:
        if not self.free_cached:
            return None
        if self.eviction == "lru":
            return next(iter(self.free_cached))
        tenant = max(self.free_cached_of, key=self.over_share)
        return next(iter(self.free_cached_of[tenant]))

    def _note_tenant(self, seq: Sequence) -> None:
        self.weights[seq.tenant.id] = seq.tenant.weight

    def _take_free(self, owner: int) -> int:
        if self.free_uncached:
            page = self.free_uncached.pop()
        elif (victim := self.eviction_candidate()) is not None:
            page = victim
            self._unpark(page)
            self._evicted(self._uncache_page(page))
        else:
            raise OutOfPages(f"Cannot allocate a page: 0 of {self.num_pages} free")
        self.ref[page] = 1
        self.ledger.take(page, owner)
        return page

    def can_allocate(self, num_new_pages: int, reused: list[int] | tuple[int, ...] = ()) -> bool:
        reclaimed = sum(1 for pg in reused if self.ref[pg] == 0)
        return num_new_pages <= self.num_free - reclaimed

    def acquire_cached(self, pages: list[int]) -> None:
        for pg in pages:
            if self.ref[pg] == 0:
                self._unpark(pg)
            self.ref[pg] += 1

    def assign(self, seq: Sequence, pages: list[int]) -> None:
        """seq (holding no pages) starts with the cached `pages`, acquired here."""
        if seq.block_table:
            raise RuntimeError(f"assign: {seq.request_id} already holds {len(seq.block_table)} pages")
        self._note_tenant(seq)
        self.acquire_cached(pages)
        for pg in pages:                     # pages fetched from an outer tier belong to their first user
            if self.owner.get(pg) == "" and seq.tenant.retain:
                self.held[""] -= 1
                if not self.held[""]:
                    del self.held[""]
                self.owner[pg] = seq.tenant.id
                self.held[seq.tenant.id] += 1
        seq.block_table = list(pages)
        seq.page_stamps = self.ledger.stamp[pages].tolist() if pages else []
        self.tables.set(seq, seq.block_table, seq.page_stamps)

    def allocate(self, seq: Sequence, num_pages: int) -> None:
        if num_pages > self.num_free:
            raise OutOfPages(f"Cannot allocate {num_pages} pages: {self.num_free} free")
        start = len(seq.block_table)
        for _ in range(num_pages):
            page = self._take_free(seq.serial)
            seq.block_table.append(page)
            seq.page_stamps.append(int(self.ledger.stamp[page]))
        self.tables.append(seq, start, seq.block_table[start:], seq.page_stamps[start:])

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens; False (nothing changed) if pages run out."""
        need = self.pages_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        self.allocate(seq, need)
        return True

    def register_full_pages(self, seq: Sequence, new_hashes: list[bytes],
                            pending: list[int] | None = None) -> list[tuple[bytes, int]]:
        """Index seq's newly filled pages in the prefix cache; returns (hash, page) pairs newly cached. `pending`: as
        Sequence.extend_hashes'."""
        out: list[tuple[bytes, int]] = []
        if not self.enable_prefix_cache or not seq.tenant.retain:    # no-retain: never cached nor published
            return out
        self._note_tenant(seq)
        p = self.page_size
        ids = seq.all_ids + pending if pending else seq.all_ids
        start = len(seq.page_hashes) - len(new_hashes)
        for j, h in enumerate(new_hashes):
            i = start + j
            page = seq.block_table[i]
            if h in self.cache or page in self.hash_of_page:
                continue
            parent = seq.page_hashes[i - 1] if i else seq.key_ctx.root
            entry = CachedPage(page, parent, tuple(ids[i * p:(i + 1) * p]), int(self.ledger.stamp[page]))
            self._cache_page(page, h, entry, seq.tenant.id)
            out.append((h, page))
        return out

    def insert_external(self, h: bytes, parent: bytes, tokens: tuple[int, ...]) -> int | None:
        """Take a free page for a page fetched from an outer tier (caller fills it); ref=1."""
        if h in self.cache or self.num_free == 0:
            return None
        page = self._take_free(EXTERNAL)
        self._cache_page(page, h, CachedPage(page, parent, tokens, int(self.ledger.stamp[page])), "")
        return page

    def drop_cached(self, h: bytes) -> None:
        hit = self.cache.get(h)
        if hit is not None:
            if self.ref[hit.page] == 0:
                self._unpark(hit.page)
                self.free_uncached.append(hit.page)
                self.ledger.retire(hit.page)
            self._uncache_page(hit.page)
            self._evicted(h)

    def free(self, seq: Sequence) -> None:
        """Give back seq's pages: with identity checks, only those it still holds (an entry whose page was freed or
        retaken under it is counted as a failure and left to its present holder)."""
        if self.check_identity:
            stamps = self.ledger.stamp
            self.ledger.checks["free"] += len(seq.block_table)
            for i in range(len(seq.block_table) - 1, -1, -1):
                page, want = seq.block_table[i], seq.page_stamps[i]
                if want == 0:                    # already found wrong (kv_integrity): not ours to give back
                    continue
                if stamps[page] != want or self.ref[page] <= 0:
                    self.ledger.fail("free", f"request {seq.request_id} gives back page {page} (stamp {want}); the "
                                             f"page has stamp {int(stamps[page])}, {self.ref[page]} holders")
                    continue
                self.release(page)
        else:
            for page in reversed(seq.block_table):
                self.release(page)
        seq.block_table = []
        seq.page_stamps = []
        self.tables.release(seq)

    def repair(self, seq: Sequence, index: int) -> None:
        """Entry `index` of seq's table names a page seq does not hold (found by an integrity check). If the page
        seq took there still carries the stamp seq recorded (the entry was overwritten), the entry names it again,
        so that seq gives it back; otherwise (the page was freed under seq) seq gives back nothing there."""
        held = np.flatnonzero(self.ledger.stamp == seq.page_stamps[index])
        if held.size and self.ref[int(held[0])] > 0:
            seq.block_table[index] = int(held[0])
            self.tables.array[seq.table_row, index] = int(held[0])
        else:
            seq.page_stamps[index] = 0
            self.tables.forget(seq, index)

    def release(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] < 0:
            raise RuntimeError(f"page {page} released more often than acquired")
        if self.ref[page] == 0:
            if page in self.hash_of_page:
                self._park(page)
            else:
                self.free_uncached.append(page)
                self.ledger.retire(page)
