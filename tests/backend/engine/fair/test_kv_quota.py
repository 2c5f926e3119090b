"""Per-tenant KV quotas in the BlockManager: eviction order of cached pages, no-retain tenants, page owners."""

from __future__ import annotations

import pytest

from edgeinfer.backend.engine.block_manager import BlockManager
from edgeinfer.protocol.wire import TenantSpec
from tests.support.fair_sim import seq


def cache_pages(blocks: BlockManager, tenant: TenantSpec, n: int, first_token: int) -> list[bytes]:
    """A finished request of `tenant` that filled n pages; returns their hashes (cached iff retained)."""
    s = seq(tenant, prompt_len=n * blocks.page_size, first_token=first_token)
    blocks.allocate(s, n)
    s.num_computed_tokens = s.num_tokens
    blocks.register_full_pages(s, s.extend_hashes())
    blocks.free(s)
    return s.page_hashes


def evict(blocks: BlockManager, n: int) -> None:
    s = seq(TenantSpec("new"), prompt_len=n * blocks.page_size, first_token=90_000)
    blocks.allocate(s, n)


@pytest.mark.parametrize("eviction", ["fair", "lru"])
def test_flood_evicts_its_own_pages_first(eviction):
    """B cached a 4-page hot prefix first; A then cached 12 pages. A new 6-page request: under fair, A (most over
    its share) loses pages and B's prefix survives; under lru B's pages, the oldest, go first."""
    blocks = BlockManager(16, 16, eviction=eviction)
    hot = cache_pages(blocks, TenantSpec("b"), 4, first_token=1)
    flood = cache_pages(blocks, TenantSpec("a"), 12, first_token=1000)
    assert blocks.held == {"a": 12, "b": 4} and blocks.num_free == 16
    evict(blocks, 6)
    kept_hot = [h for h in hot if h in blocks.cache]
    kept_flood = [h for h in flood if h in blocks.cache]
    if eviction == "fair":
        assert kept_hot == hot and len(kept_flood) == 6
        assert blocks.held == {"a": 6, "b": 4}
    else:
        assert kept_hot == [] and len(kept_flood) == 10


def test_eviction_follows_weights_and_alternates_at_equal_share():
    blocks = BlockManager(16, 16)
    cache_pages(blocks, TenantSpec("heavy", weight=4.0), 8, first_token=1)     # 8 / 4 = 2 per unit of weight
    cache_pages(blocks, TenantSpec("light", weight=1.0), 4, first_token=500)   # 4 / 1 = 4
    cache_pages(blocks, TenantSpec("mid", weight=1.0), 4, first_token=900)     # 4 / 1 = 4
    order = []
    for _ in range(8):
        page = blocks.eviction_candidate()
        assert page is not None
        order.append(blocks.owner[page])
        evict(blocks, 1)
    # light and mid (4 per unit) go down to 2 each before heavy (2 per unit) is touched, then all three share
    assert sorted(order[:4]) == ["light", "light", "mid", "mid"]
    assert blocks.held["heavy"] / 4 >= 1 and blocks.held["light"] >= 1 and blocks.held["mid"] >= 1
    assert sum(blocks.held.values()) == 8


def test_lru_within_a_tenant():
    blocks = BlockManager(8, 16)
    first = cache_pages(blocks, TenantSpec("a"), 2, first_token=1)
    second = cache_pages(blocks, TenantSpec("a"), 2, first_token=100)
    theirs = cache_pages(blocks, TenantSpec("b"), 4, first_token=200)
    evict(blocks, 3)    # a and b hold 4 each: a (first in a tie), then b, then the tie again
    assert blocks.held == {"a": 2, "b": 3}
    # each tenant loses its least recently freed pages (a request frees its deepest page first)
    assert first[0] not in blocks.cache and first[1] not in blocks.cache and theirs[3] not in blocks.cache
    assert all(h in blocks.cache for h in second + theirs[:3])


def test_no_retain_tenant_pages_are_never_cached():
    blocks = BlockManager(8, 16)
    hashes = cache_pages(blocks, TenantSpec("p", retain=False), 4, first_token=1)
    assert len(hashes) == 4
    assert not any(h in blocks.cache for h in hashes)
    assert blocks.held == {} and not blocks.free_cached and len(blocks.free_uncached) == 8


def test_external_page_belongs_to_its_first_user():
    blocks = BlockManager(8, 16)
    t = TenantSpec("a")
    s = seq(t, prompt_len=33)
    h = s.prompt_page_hashes()[0]
    page = blocks.insert_external(h, s.key_ctx.root, tuple(s.prompt_ids[:16]))
    assert page is not None and blocks.owner[page] == "" and blocks.held == {"": 1}
    blocks.release(page)
    match = blocks.match_prefix(s, s.prompt_page_hashes())
    assert match.pages == [page]
    blocks.assign(s, match.pages)
    assert blocks.owner[page] == "a" and blocks.held == {"a": 1}
    blocks.free(s)
    assert blocks.free_cached_of == {"a": {page: None}}


def test_drop_cached_keeps_the_books():
    blocks = BlockManager(8, 16)
    hashes = cache_pages(blocks, TenantSpec("a"), 3, first_token=1)
    blocks.drop_cached(hashes[1])
    assert blocks.held == {"a": 2} and len(blocks.free_cached) == 2 and len(blocks.free_cached_of["a"]) == 2
    assert blocks.num_free == 8


def test_bad_eviction_policy_is_rejected():
    with pytest.raises(ValueError, match="eviction='mru' is invalid"):
        BlockManager(8, 16, eviction="mru")
