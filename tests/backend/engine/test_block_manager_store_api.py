"""The narrow view of the prefix cache the page store uses (issue 18): lookup, cached_prefix_len, cached_pages,
insert_external and subscribe_evictions, instead of reading BlockManager.cache and setting on_evict."""

from __future__ import annotations

from edgeinfer.backend.engine.block_manager import BlockManager
from edgeinfer.protocol.wire import TenantSpec
from tests.backend.engine.fair.test_kv_quota import cache_pages, evict
from tests.support.fair_sim import seq


def test_evictions_reach_every_subscriber_until_it_unsubscribes():
    blocks = BlockManager(4, 16, eviction="lru")
    hashes = cache_pages(blocks, TenantSpec("a"), 4, first_token=1)
    first: list[bytes] = []
    second: list[bytes] = []
    unsubscribe = blocks.subscribe_evictions(first.append)
    blocks.subscribe_evictions(second.append)
    evict(blocks, 1)                  # the deepest page was freed first: the least recently used
    assert first == second == [hashes[3]]
    unsubscribe()
    unsubscribe()   # twice is harmless
    blocks.drop_cached(hashes[0])
    assert first == [hashes[3]] and second == [hashes[3], hashes[0]]


def test_lookup_prefix_and_listing_agree_with_the_cache():
    blocks = BlockManager(8, 16)
    s = seq(TenantSpec("a"), prompt_len=4 * 16, first_token=7)
    hashes = cache_pages(blocks, TenantSpec("a"), 4, first_token=7)
    ids, root = s.all_ids, s.key_ctx.root
    assert blocks.cached_prefix_len(hashes, ids, root) == 4
    assert blocks.cached_prefix_len(hashes, ids[:16] + [0] * 48, root) == 1     # tokens compared, not just hashes
    assert blocks.cached_prefix_len(hashes[1:], ids[16:], root) == 0            # parent compared
    assert blocks.match_prefix(s, hashes).num_pages == 4
    assert sorted(h for h, _ in blocks.cached_pages()) == sorted(hashes)
    assert all(blocks.lookup(h).page == page for h, page in blocks.cached_pages())
    assert blocks.lookup(b"\0" * 16) is None
    blocks.drop_cached(hashes[2])
    assert blocks.cached_prefix_len(hashes, ids, root) == 2 == blocks.match_prefix(s, hashes).num_pages
