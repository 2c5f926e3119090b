"""Prefix-cache-aware routing: pick the node that saves the most prefill, unless it is much busier.

score(node) = cached_pages * page_size                      (tokens the node would not recompute)
            - route_load_cost_tokens * node.load            (in-flight + registry-reported queue)
            - route_kv_cost_tokens * node.kv_usage          (KV pool occupancy, 0..1, from its /ready)
            + route_affinity_tokens  [node == HRW(x-session-affinity)]

With prefill/decode disaggregation (gateway/generation.py) this ranks the decode node; the prefill node is
ranked by tokens (`rank_prefill`): the prompt tokens it would compute less those it holds cached, plus the
prompt tokens already waiting on it (this gateway's prefill hops in flight and its reported queue):

score_prefill(node) = cached_pages * page_size - (node.prefill_pending + node.prefill_queued)

The affinity node is chosen by rendezvous (highest-random-weight) hashing over the live nodes, so a
session stays put while its node lives and only its own sessions move when membership changes.
Page hashes use the tenant's namespace (never the request's) and each node's model fingerprint,
kv format and page size, so nodes of two versions of a model are scored with their own keys.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import xxhash

from edgeinfer.gateway.nodes import Node
from edgeinfer.protocol.page_id import PageKeyContext, page_hashes


class PrefixIndex(Protocol):
    """What routing needs from cache_store.index.PageIndex (Redis or in-memory)."""

    async def longest_prefix(self, model: str, hashes: Sequence[bytes]) -> dict[str, int]: ...

    async def publish(self, model: str, node_id: str, hashes: Sequence[bytes]) -> bool: ...


class Choice(NamedTuple):
    node: Node
    cached_pages: int
    decision: str             # "prefix" | "affinity" | "load"
    hashes: list[bytes]       # the prompt's page hashes for this node's page format


def affinity_node(session: str, nodes: Sequence[Node]) -> Node | None:
    if not session or not nodes:
        return None
    return max(nodes, key=lambda n: xxhash.xxh64_intdigest(f"{session}\x00{n.node_id}".encode()))


class Router:
    def __init__(self, index: PrefixIndex, seed: bytes, load_cost_tokens: int = 32,
                 affinity_tokens: int = 256, kv_cost_tokens: int = 256) -> None:
        self.index = index
        self.seed = seed
        self.load_cost = load_cost_tokens
        self.affinity_bonus = affinity_tokens
        self.kv_cost = kv_cost_tokens
        self._contexts: dict[tuple[str, str, str, int], tuple[PageKeyContext, bytes]] = {}  # -> (ctx, root hash)

    def hashes_for(self, namespace: str, node: Node, tokens: Sequence[int]) -> list[bytes]:
        info = node.info
        assert info is not None  # routable nodes have info
        key = (namespace, info.model_fingerprint, info.kv_format, info.page_size)
        ctx_root = self._contexts.get(key)
        if ctx_root is None:
            if len(self._contexts) >= 10_000:
                self._contexts.clear()
            ctx = PageKeyContext(self.seed, namespace, info.model_fingerprint, info.kv_format, info.page_size)
            ctx_root = self._contexts[key] = (ctx, ctx.root)
        return page_hashes(ctx_root[0], tokens, start_parent=ctx_root[1])

    async def rank(self, model: str, namespace: str, tokens: Sequence[int], nodes: Sequence[Node],
                   session: str = "") -> list[Choice]:
        """Nodes best first. One index lookup per distinct page format among `nodes` (usually one)."""
        groups = _by_format(nodes)
        sticky = affinity_node(session, nodes)
        scored: list[tuple[float, float, Choice]] = []
        for (_, _, page_size), members in groups.items():
            hashes = self.hashes_for(namespace, members[0], tokens)
            held = await self.index.longest_prefix(model, hashes) if hashes else {}
            for n in members:
                pages = held.get(n.node_id, 0)
                is_sticky = n is sticky
                score = (pages * page_size - self.load_cost * n.load - self.kv_cost * n.kv_usage
                         + (self.affinity_bonus if is_sticky else 0))
                decision = "prefix" if pages else ("affinity" if is_sticky else "load")
                scored.append((-score, random.random(), Choice(n, pages, decision, hashes)))
        scored.sort(key=lambda s: (s[0], s[1]))  # ties (equal load, nothing cached) spread at random
        return [c for _, _, c in scored]

    async def rank_prefill(self, model: str, namespace: str, tokens: Sequence[int],
                           nodes: Sequence[Node]) -> list[Choice]:
        """Prefill nodes best first, by tokens: cached prompt tokens less the prompt tokens waiting on the node."""
        scored: list[tuple[float, float, Choice]] = []
        for members in _by_format(nodes).values():
            page_size = members[0].info.page_size  # type: ignore[union-attr]
            hashes = self.hashes_for(namespace, members[0], tokens)
            held = await self.index.longest_prefix(model, hashes) if hashes else {}
            for n in members:
                pages = held.get(n.node_id, 0)
                score = pages * page_size - (n.prefill_pending + n.prefill_queued)
                scored.append((-score, random.random(), Choice(n, pages, "prefill", hashes)))
        scored.sort(key=lambda s: (s[0], s[1]))
        return [c for _, _, c in scored]


def _by_format(nodes: Sequence[Node]) -> dict[tuple[str, str, int], list[Node]]:
    groups: dict[tuple[str, str, int], list[Node]] = {}
    for n in nodes:
        i = n.info
        groups.setdefault((i.model_fingerprint, i.kv_format, i.page_size), []).append(n)  # type: ignore[union-attr]
    return groups
