"""Page index: which nodes hold which pages, for prefix-cache-aware routing.

`<prefix>:idx:{<model>}:<page_hash hex>` -> set of node ids, TTL refreshed on
use. The hash tag {<model>} puts every index key of one model on one cluster
slot, so a longest-prefix lookup is one pipeline to one node even on a Redis
Cluster. Page hashes are namespace-salted, so tenants never match each other.
"""

from __future__ import annotations

import abc
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from redis.exceptions import NoScriptError

from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.cache_store.resilience import RedisGuard
from edgeinfer.cache_store.store import PageStore


class PageIndex(abc.ABC):
    """Maps (model, page hash) to the set of nodes that hold the page.

    Invariants:
    - publish is called only with pages whose write the holding tier
      acknowledged (use store_and_publish); an entry may outlive the page
      (eviction, TTL), never precede it, so a hit is a hint and the fetched
      page is still verified.
    - longest_prefix(model, hashes)[node] = n means the node holds
      hashes[0:n]; nodes with n == 0 are absent from the result.
    - Failures (Redis down) look like an empty index, never like an error.
    - round_trips counts network round trips made (0 for in-memory).
    """

    round_trips: int

    @abc.abstractmethod
    async def publish(self, model: str, node_id: str, hashes: Sequence[bytes]) -> bool: ...

    @abc.abstractmethod
    async def longest_prefix(self, model: str, hashes: Sequence[bytes]) -> dict[str, int]: ...

    @abc.abstractmethod
    async def remove_node(self, model: str, node_id: str, hashes: Sequence[bytes]) -> bool: ...


def leading_counts(holders: Sequence[set[str]]) -> dict[str, int]:
    """holders[i] = nodes holding page i -> per node, how many leading pages it holds."""
    counts: dict[str, int] = {}
    alive: set[str] | None = None
    for i, nodes in enumerate(holders):
        alive = set(nodes) if alive is None else alive & nodes
        if not alive:
            break
        for node in alive:
            counts[node] = i + 1
    return counts


# KEYS: index keys in prefix order; ARGV[1]: ttl seconds. Returns {node, count, ...}.
_LOOKUP_LUA = """
local alive, counts = nil, {}
for i, key in ipairs(KEYS) do
  local members = redis.call('SMEMBERS', key)
  local still, any = {}, false
  for _, m in ipairs(members) do
    if alive == nil or alive[m] then still[m] = true; any = true end
  end
  if not any then break end
  alive = still
  for m in pairs(alive) do counts[m] = i end
  redis.call('EXPIRE', key, ARGV[1])
end
local out = {}
for m, c in pairs(counts) do out[#out + 1] = m; out[#out + 1] = c end
return out
"""
_LOOKUP_SHA = hashlib.sha1(_LOOKUP_LUA.encode()).hexdigest()


class RedisPageIndex(PageIndex):
    """Index in Redis (single server or Cluster).

    Lookup walks the prefix server-side in one Lua call (one round trip; two
    the first time a server sees the script). All keys of a lookup share the
    {<model>} hash tag, so the script is legal on a cluster. With
    server_side=False (scripting disabled) it pipelines SMEMBERS+EXPIRE in
    chunks of chunk_pages, stopping once no node holds the prefix: at most
    ceil(len(hashes) / chunk_pages) round trips.
    """

    def __init__(self, client, *, ttl_s: int = 3600, keys: KeySpace | None = None,
                 guard: RedisGuard | None = None, chunk_pages: int = 256, server_side: bool = True) -> None:
        if ttl_s <= 0 or chunk_pages <= 0:
            raise ValueError(f"ttl_s and chunk_pages must be positive, got {ttl_s}, {chunk_pages}")
        self.client = client
        self.ttl_s = ttl_s
        self.keys = keys or KeySpace()
        self.guard = guard or RedisGuard()
        self.chunk_pages = chunk_pages
        self.server_side = server_side
        self.round_trips = 0

    async def _execute(self, fill) -> list:
        self.round_trips += 1
        pipe = self.client.pipeline(transaction=False)
        fill(pipe)
        return await pipe.execute(raise_on_error=False)

    async def publish(self, model: str, node_id: str, hashes: Sequence[bytes]) -> bool:
        if not hashes:
            return True
        prefix = self.keys.idx_prefix(model)
        node = node_id.encode()

        def fill(pipe) -> None:
            for h in hashes:
                key = prefix + h.hex()
                pipe.sadd(key, node)
                pipe.expire(key, self.ttl_s)

        results = await self.guard.run(lambda: self._execute(fill), None, "index publish")
        return results is not None and not any(isinstance(r, Exception) for r in results)

    async def longest_prefix(self, model: str, hashes: Sequence[bytes]) -> dict[str, int]:
        if not hashes:
            return {}
        if self.server_side:
            return await self._longest_prefix_script(model, hashes)
        return await self._longest_prefix_pipelined(model, hashes)

    async def _longest_prefix_script(self, model: str, hashes: Sequence[bytes]) -> dict[str, int]:
        prefix = self.keys.idx_prefix(model)
        keys = [prefix + h.hex() for h in hashes]

        async def run() -> list:
            self.round_trips += 1
            try:
                return await self.client.evalsha(_LOOKUP_SHA, len(keys), *keys, self.ttl_s)
            except NoScriptError:
                self.round_trips += 1
                return await self.client.eval(_LOOKUP_LUA, len(keys), *keys, self.ttl_s)

        flat = await self.guard.run(run, None, "index lookup")
        if not flat:
            return {}
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def _longest_prefix_pipelined(self, model: str, hashes: Sequence[bytes]) -> dict[str, int]:
        prefix = self.keys.idx_prefix(model)
        holders: list[set[str]] = []
        alive: set[str] | None = None
        for start in range(0, len(hashes), self.chunk_pages):
            chunk = [prefix + h.hex() for h in hashes[start:start + self.chunk_pages]]
            results = await self.guard.run(partial(self._execute, self._lookup_fill(chunk)), None,
                                           "index lookup")
            if results is None:
                break
            for members in results[0::2]:
                nodes = {m.decode() for m in members} if isinstance(members, set) else set()
                alive = nodes if alive is None else alive & nodes
                if not alive:
                    break
                holders.append(nodes)
            if not alive:
                break
        return leading_counts(holders)

    def _lookup_fill(self, keys: list[str]) -> Callable[[Any], None]:
        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.smembers(key)
                pipe.expire(key, self.ttl_s)

        return fill

    async def remove_node(self, model: str, node_id: str, hashes: Sequence[bytes]) -> bool:
        if not hashes:
            return True
        prefix = self.keys.idx_prefix(model)
        node = node_id.encode()

        def fill(pipe) -> None:
            for h in hashes:
                pipe.srem(prefix + h.hex(), node)

        results = await self.guard.run(lambda: self._execute(fill), None, "index remove")
        return results is not None and not any(isinstance(r, Exception) for r in results)


class InMemoryPageIndex(PageIndex):
    """Single-node mode: same interface and TTL semantics, no I/O; thread-safe."""

    def __init__(self, *, ttl_s: float = 3600, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.round_trips = 0
        self._clock = clock
        self._entries: dict[tuple[str, bytes], dict[str, float]] = {}
        self._lock = threading.Lock()

    def _live(self, key: tuple[str, bytes], now: float) -> dict[str, float] | None:
        nodes = self._entries.get(key)
        if nodes is None:
            return None
        if all(exp <= now for exp in nodes.values()):  # a Redis set expires as a whole
            del self._entries[key]
            return None
        return nodes

    async def publish(self, model: str, node_id: str, hashes: Sequence[bytes]) -> bool:
        with self._lock:
            now = self._clock()
            for h in hashes:
                nodes = self._live((model, h), now)
                if nodes is None:
                    nodes = self._entries[(model, h)] = {}
                nodes[node_id] = 0.0
                expiry = now + self.ttl_s
                for n in nodes:
                    nodes[n] = expiry
        return True

    async def longest_prefix(self, model: str, hashes: Sequence[bytes]) -> dict[str, int]:
        holders: list[set[str]] = []
        with self._lock:
            now = self._clock()
            alive: set[str] | None = None
            for h in hashes:
                nodes = self._live((model, h), now)
                found = set(nodes) if nodes else set()
                alive = found if alive is None else alive & found
                if not alive:
                    break
                for n in nodes:  # type: ignore[union-attr]
                    nodes[n] = now + self.ttl_s  # type: ignore[index]
                holders.append(found)
        return leading_counts(holders)

    async def remove_node(self, model: str, node_id: str, hashes: Sequence[bytes]) -> bool:
        with self._lock:
            for h in hashes:
                nodes = self._entries.get((model, h))
                if nodes is not None:
                    nodes.pop(node_id, None)
                    if not nodes:
                        del self._entries[(model, h)]
        return True


async def store_and_publish(store: PageStore, index: PageIndex, model: str, node_id: str,
                            pages: Sequence[tuple[bytes, bytes]]) -> list[bool]:
    """Write pages to `store`, then index only the acknowledged ones. Returns the acks."""
    acks = await store.put_many(pages)
    acked = [key for (key, _), ok in zip(pages, acks, strict=True) if ok]
    if acked:
        await index.publish(model, node_id, acked)
    return acks

