"""Page stores: where encoded page blobs live outside the engine's KV pool.

Keys are page hashes (16 bytes). Page hashes are already salted with the cache
namespace (tenant or sharing group), the model fingerprint and the kv format
(see protocol/page_id.py), so a store keyed by page hash alone never lets two
namespaces meet; no tier may key pages by anything weaker than the full hash.
Stores move opaque blobs: verification is codec.decode's job, on every read.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.cache_store.resilience import RedisGuard


class PageStore(abc.ABC):
    """Blob store keyed by page hash.

    Invariants:
    - put_many returns one bool per item, True only once the tier holds the
      whole blob (acknowledged); only acknowledged pages may be indexed.
    - get_many returns one entry per key, in order: the blob or None (absent,
      evicted, expired or the tier unreachable). It never raises for an
      unreachable tier.
    - A blob is returned exactly as stored or not at all; callers still verify
      the tag because bytes can rot in memory, on the wire or in the tier.
    - delete_many is idempotent; deleting a missing key is not an error.
    """

    @abc.abstractmethod
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    @abc.abstractmethod
    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]: ...

    @abc.abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> None: ...


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected: int = 0
    evictions: int = 0
    deletes: int = 0


class HostPageStore(PageStore):
    """Host-memory tier: LRU under a byte budget; thread-safe (engine thread and event loop share it)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.stats = StoreStats()
        self._pages: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            blob = self._pages.get(key)
            if blob is None:
                self.stats.misses += 1
                return None
            self._pages.move_to_end(key)
            self.stats.hits += 1
            return blob

    def put(self, key: bytes, blob: bytes | bytearray | memoryview) -> bool:
        data = blob if isinstance(blob, bytes) else bytes(blob)
        size = len(data)
        with self._lock:
            if size > self.capacity_bytes:
                self.stats.rejected += 1
                return False
            old = self._pages.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self.used_bytes + size > self.capacity_bytes:
                _, evicted = self._pages.popitem(last=False)
                self.used_bytes -= len(evicted)
                self.stats.evictions += 1
            self._pages[key] = data
            self.used_bytes += size
            self.stats.puts += 1
            return True

    def delete(self, key: bytes) -> None:
        with self._lock:
            old = self._pages.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
                self.stats.deletes += 1

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        return [self.put(k, b) for k, b in items]

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.delete(k)


class RedisPageStore(PageStore):
    """Shared tier: `<prefix>:page:{<hash hex>}` with a TTL; one pipeline per call.

    Works with redis.asyncio.Redis and redis.asyncio.cluster.RedisCluster (each
    page key is its own hash tag, so a cluster pipeline fans out per node).
    Reads refresh the TTL (GETEX). Every call goes through `guard`: when Redis
    is slow or down, reads return None and writes False, quickly.
    """

    def __init__(self, client, *, ttl_s: int = 3600, keys: KeySpace | None = None,
                 guard: RedisGuard | None = None, timeout_s: float = 1.0,
                 refresh_ttl_on_get: bool = True) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.client = client
        self.ttl_s = ttl_s
        self.keys = keys or KeySpace()
        self.guard = guard or RedisGuard()
        self.timeout_s = timeout_s
        self.refresh_ttl_on_get = refresh_ttl_on_get
        self.stats = StoreStats()
        self.round_trips = 0

    async def _execute(self, fill) -> list:
        self.round_trips += 1
        pipe = self.client.pipeline(transaction=False)
        fill(pipe)
        return await pipe.execute(raise_on_error=False)

    async def get_many(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bytes | None]:
        """`timeout_s` overrides the store's per-call timeout (a caller with a deadline passes what is left)."""
        if not keys:
            return []
        names = [self.keys.page(k) for k in keys]

        def fill(pipe) -> None:
            for name in names:
                if self.refresh_ttl_on_get:
                    pipe.getex(name, ex=self.ttl_s)
                else:
                    pipe.get(name)

        results = await self.guard.run(lambda: self._execute(fill), None, "page get",
                                       self.timeout_s if timeout_s is None else timeout_s)
        if results is None:
            self.stats.misses += len(keys)
            return [None] * len(keys)
        out: list[bytes | None] = [r if isinstance(r, bytes) else None for r in results]
        hits = sum(r is not None for r in out)
        self.stats.hits += hits
        self.stats.misses += len(out) - hits
        return out

    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        if not items:
            return []

        def fill(pipe) -> None:
            for key, blob in items:
                pipe.set(self.keys.page(key), blob, ex=self.ttl_s)

        results = await self.guard.run(lambda: self._execute(fill), None, "page put", self.timeout_s)
        if results is None:
            self.stats.rejected += len(items)
            return [False] * len(items)
        acks = [r is True for r in results]
        self.stats.puts += sum(acks)
        self.stats.rejected += len(acks) - sum(acks)
        return acks

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return

        def fill(pipe) -> None:
            for key in keys:
                pipe.execute_command("UNLINK", self.keys.page(key))

        results = await self.guard.run(lambda: self._execute(fill), None, "page delete", self.timeout_s)
        if results is not None:
            self.stats.deletes += sum(r == 1 for r in results)


class TieredPageStore(PageStore):
    """Several tiers read nearest first (e.g. host memory, then Redis), written to all.

    - get_many_sourced: per key (blob, tier name) or None; each tier is asked
      once (one pipeline for Redis), only for the keys the nearer tiers lacked.
    - put_many: one ack per item, True when at least one tier holds the blob
      (this node can serve it, so it may be indexed under this node).
    - delete_many: from every tier; delete_from(name, keys): from one tier (an
      integrity failure is the business of the tier the bad bytes came from).
    """

    def __init__(self, tiers: Sequence[tuple[str, PageStore]]) -> None:
        if not tiers:
            raise ValueError("TieredPageStore needs at least one tier")
        self.tiers = list(tiers)
        self._by_name = dict(self.tiers)

    def tier(self, name: str) -> PageStore | None:
        return self._by_name.get(name)

    async def get_many_sourced(self, keys: Sequence[bytes],
                               timeout_s: float | None = None) -> list[tuple[bytes, str] | None]:
        out: list[tuple[bytes, str] | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for name, store in self.tiers:
            if not todo:
                break
            want = [keys[i] for i in todo]
            if isinstance(store, RedisPageStore):
                blobs = await store.get_many(want, timeout_s=timeout_s)
            else:
                blobs = await store.get_many(want)
            still = []
            for i, blob in zip(todo, blobs, strict=True):
                if blob is None:
                    still.append(i)
                else:
                    out[i] = (blob, name)
            todo = still
        return out

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [None if r is None else r[0] for r in await self.get_many_sourced(keys)]

    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        acks = [False] * len(items)
        for _, store in self.tiers:
            for i, ok in enumerate(await store.put_many(items)):
                acks[i] = acks[i] or ok
        return acks

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        for _, store in self.tiers:
            await store.delete_many(keys)

    async def delete_from(self, name: str, keys: Sequence[bytes]) -> None:
        store = self._by_name.get(name)
        if store is not None:
            await store.delete_many(keys)
