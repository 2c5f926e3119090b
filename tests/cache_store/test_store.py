import random
import threading

import pytest

from edgeinfer.cache_store.codec import Miss, PageFormat, PageKey, decode, encode
from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.cache_store.store import HostPageStore, RedisPageStore

FMT = PageFormat(model_fingerprint="m@1", kv_dtype="bfloat16", num_layers=2, kv_heads=1, head_dim=8)
KEY = PageKey.from_secret(b"page-store-test-key")


def pages(n: int, body_bytes: int = 1024, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        h, parent = rng.randbytes(16), rng.randbytes(16)
        tokens = [rng.randrange(50000) for _ in range(16)]
        out.append((h, encode(FMT.header(h, parent, tokens), rng.randbytes(body_bytes), KEY),
                    FMT.expect(h, parent, tokens)))
    return out


# host tier

async def test_host_lru_eviction_by_bytes():
    store = HostPageStore(capacity_bytes=3000)
    items = [(bytes([i]) * 16, bytes([i]) * 1000) for i in range(4)]
    assert await store.put_many(items[:3]) == [True] * 3
    assert store.used_bytes == 3000
    await store.get_many([items[0][0]])  # page 0 becomes most recent; page 1 is now the LRU
    assert await store.put_many([items[3]]) == [True]
    assert [k in store for k, _ in items] == [True, False, True, True]
    assert store.used_bytes == 3000 and store.stats.evictions == 1
    big = (b"b" * 16, b"x" * 1500)  # needs two evictions, least recent first: 2 then 0
    assert store.put(*big)
    assert [k in store for k, _ in items] == [False, False, False, True]
    assert store.used_bytes == 2500 and store.stats.evictions == 3


async def test_host_rejects_oversized_and_replaces_in_place():
    store = HostPageStore(capacity_bytes=100)
    assert await store.put_many([(b"k" * 16, b"x" * 101)]) == [False]
    assert store.stats.rejected == 1 and store.used_bytes == 0
    assert store.put(b"k" * 16, b"a" * 60) and store.put(b"k" * 16, bytearray(b"b" * 70))
    assert store.used_bytes == 70 and len(store) == 1
    assert await store.get_many([b"k" * 16, b"z" * 16]) == [b"b" * 70, None]
    await store.delete_many([b"k" * 16, b"z" * 16])
    assert store.used_bytes == 0 and len(store) == 0


def test_host_store_is_thread_safe():
    store = HostPageStore(capacity_bytes=50_000)

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(2000):
            key = rng.randbytes(1) * 16
            op = rng.random()
            if op < 0.5:
                store.put(key, b"x" * rng.randrange(1, 2000))
            elif op < 0.9:
                store.get(key)
            else:
                store.delete(key)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.used_bytes == sum(len(b) for b in store._pages.values()) <= store.capacity_bytes


async def test_host_tier_detects_200_corrupted_pages():
    rng = random.Random(21)
    items = pages(200, seed=1)
    store = HostPageStore(capacity_bytes=10 << 20)
    await store.put_many([(h, blob) for h, blob, _ in items])
    for h, blob, _ in items:  # bit rot in host memory
        bad = bytearray(blob)
        bit = rng.randrange(len(bad) * 8)
        bad[bit // 8] ^= 1 << (bit % 8)
        store._pages[h] = bytes(bad)
    blobs = await store.get_many([h for h, _, _ in items])
    results = [decode(b, e, KEY) for b, (_, _, e) in zip(blobs, items, strict=True)]
    assert all(isinstance(r, Miss) and r.integrity_failure for r in results)


# Redis tier: single server and 3-node cluster

async def test_redis_round_trip_and_ttl(redis, guard):
    store = RedisPageStore(redis, ttl_s=120, guard=guard)
    items = pages(20)
    assert await store.put_many([(h, b) for h, b, _ in items]) == [True] * 20
    keys = [h for h, _, _ in items]
    got = await store.get_many(keys + [b"\0" * 16])
    assert got[:20] == [b for _, b, _ in items] and got[20] is None
    for h in keys[:3]:
        assert 110_000 < await redis.pttl(KeySpace().page(h)) <= 120_000
    assert store.stats.hits == 20 and store.stats.misses == 1


async def test_redis_get_refreshes_ttl(redis, guard):
    store = RedisPageStore(redis, ttl_s=100, guard=guard)
    (h, blob, _), = pages(1)
    await store.put_many([(h, blob)])
    await redis.pexpire(KeySpace().page(h), 5_000)
    assert await store.get_many([h]) == [blob]
    assert await redis.pttl(KeySpace().page(h)) > 90_000


async def test_redis_delete_and_key_prefix(redis, guard):
    keys = KeySpace("edge-test")
    store = RedisPageStore(redis, keys=keys, guard=guard)
    items = pages(5)
    await store.put_many([(h, b) for h, b, _ in items])
    assert await redis.exists(keys.page(items[0][0])) == 1
    assert await redis.exists(KeySpace().page(items[0][0])) == 0
    await store.delete_many([h for h, _, _ in items[:3]])
    assert [b is None for b in await store.get_many([h for h, _, _ in items])] == [True] * 3 + [False] * 2
    await store.delete_many([h for h, _, _ in items[:3]])  # idempotent


async def test_redis_tier_detects_200_corrupted_pages_and_deletes_them(redis, guard):
    rng = random.Random(22)
    store = RedisPageStore(redis, guard=guard)
    items = pages(200, seed=2)
    assert all(await store.put_many([(h, b) for h, b, _ in items]))
    for i, (h, blob, _) in enumerate(items):  # corrupt in place, on the server
        offset = rng.randrange(0, 60) if i % 2 else rng.randrange(60, len(blob))  # header or body
        byte = blob[offset] ^ (1 << rng.randrange(8))
        await redis.setrange(KeySpace().page(h), offset, bytes([byte]))
    blobs = await store.get_many([h for h, _, _ in items])
    assert all(b is not None for b in blobs)
    results = [decode(b, e, KEY) for b, (_, _, e) in zip(blobs, items, strict=True)]
    failed = [h for (h, _, _), r in zip(items, results, strict=True) if isinstance(r, Miss) and r.integrity_failure]
    assert len(failed) == 200
    await store.delete_many(failed)
    assert await store.get_many(failed[:10]) == [None] * 10


async def test_redis_store_with_few_mb_pages(redis, guard):
    store = RedisPageStore(redis, guard=guard)
    items = pages(3, body_bytes=3 << 20)
    assert await store.put_many([(h, b) for h, b, _ in items]) == [True] * 3
    got = await store.get_many([h for h, _, _ in items])
    assert got == [b for _, b, _ in items]


def test_rejects_nonsense_settings():
    with pytest.raises(ValueError, match="capacity_bytes must be positive, got 0"):
        HostPageStore(0)
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        RedisPageStore(object(), ttl_s=0)


async def test_tiered_store_reads_nearest_first_writes_all_and_deletes_per_tier(redis, guard):
    from edgeinfer.cache_store.store import HostPageStore, RedisPageStore, TieredPageStore

    host = HostPageStore(1 << 20)
    remote = RedisPageStore(redis, guard=guard, timeout_s=2.0)
    tiers = TieredPageStore([("host", host), ("redis", remote)])
    keys = [bytes([i]) * 16 for i in range(4)]
    assert await tiers.put_many([(k, b"v" + k) for k in keys[:2]]) == [True, True]
    await host.delete_many([keys[1]])
    await remote.put_many([(keys[2], b"r2")])
    before = remote.round_trips
    got = await tiers.get_many_sourced(keys)
    assert got == [(b"v" + keys[0], "host"), (b"v" + keys[1], "redis"), (b"r2", "redis"), None]
    assert remote.round_trips - before == 1          # one pipeline for everything the host tier lacked
    await tiers.delete_from("redis", [keys[0]])
    assert await remote.get_many([keys[0]]) == [None] and host.get(keys[0]) == b"v" + keys[0]
    await tiers.delete_many(keys)
    assert await tiers.get_many(keys) == [None] * 4
