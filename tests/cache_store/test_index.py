import pytest

from edgeinfer.cache_store.index import InMemoryPageIndex, RedisPageIndex, leading_counts, store_and_publish
from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.cache_store.store import HostPageStore, PageStore, RedisPageStore
from edgeinfer.protocol.page_id import PageKeyContext, page_hashes
from tests.support.redis_server import ValkeyServer

MODEL = "smollm2-135m"


def chain(n: int, namespace: str = "tenant-a") -> list[bytes]:
    ctx = PageKeyContext(seed=b"s", namespace=namespace, model_fingerprint="fp", kv_format="bfloat16")
    return page_hashes(ctx, list(range(n * 16)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["lua", "pipelined", "memory"])
def make_index(request, redis_kind):
    if request.param == "memory":
        if redis_kind == "cluster":
            pytest.skip("in-memory index has no cluster variant")
        return lambda **kw: InMemoryPageIndex(**{k: v for k, v in kw.items() if k == "ttl_s"})
    redis = request.getfixturevalue("redis")
    guard = request.getfixturevalue("guard")
    server_side = request.param == "lua"
    return lambda **kw: RedisPageIndex(redis, guard=guard, server_side=server_side, **kw)


def test_leading_counts():
    assert leading_counts([{"a", "b"}, {"a"}, {"a", "b"}]) == {"a": 3, "b": 1}
    assert leading_counts([{"b"}, {"a", "b"}]) == {"b": 2}
    assert leading_counts([set(), {"a"}]) == {}
    assert leading_counts([]) == {}


async def test_longest_prefix_with_several_nodes(make_index):
    index = make_index()
    h = chain(10)
    assert await index.publish(MODEL, "a", h)
    assert await index.publish(MODEL, "b", h[:5])
    assert await index.publish(MODEL, "c", h[:3] + h[4:])  # hole at page 3
    assert await index.publish(MODEL, "d", h[1:])  # lacks the first page
    assert await index.longest_prefix(MODEL, h) == {"a": 10, "b": 5, "c": 3}
    assert await index.longest_prefix(MODEL, h[:2]) == {"a": 2, "b": 2, "c": 2}
    assert await index.longest_prefix("other-model", h) == {}
    assert await index.longest_prefix(MODEL, []) == {}


async def test_remove_node(make_index):
    index = make_index()
    h = chain(6)
    await index.publish(MODEL, "a", h)
    await index.publish(MODEL, "b", h)
    assert await index.remove_node(MODEL, "a", h[3:])
    assert await index.longest_prefix(MODEL, h) == {"a": 3, "b": 6}
    await index.remove_node(MODEL, "b", h)
    assert await index.longest_prefix(MODEL, h) == {"a": 3}


async def test_namespace_isolation(make_index, redis):
    index, store = make_index(), RedisPageStore(redis)
    a, b = chain(4, "tenant-a"), chain(4, "tenant-b")
    assert not set(a) & set(b)
    await store_and_publish(store, index, MODEL, "node-1", [(h, b"page") for h in a])
    assert await index.longest_prefix(MODEL, a) == {"node-1": 4}
    assert await index.longest_prefix(MODEL, b) == {}
    assert await store.get_many(b) == [None] * 4


async def test_one_round_trip_per_lookup(redis, redis_kind, guard):
    index = RedisPageIndex(redis, guard=guard)
    h = chain(256)  # a 4k-token prompt
    await index.publish(MODEL, "a", h)
    await index.publish(MODEL, "b", h[:100])
    await redis.script_flush()  # RedisCluster sends it to every primary
    before = index.round_trips
    assert await index.longest_prefix(MODEL, h) == {"a": 256, "b": 100}
    assert index.round_trips - before == 2  # NOSCRIPT, then EVAL loads it
    before = index.round_trips
    assert await index.longest_prefix(MODEL, h) == {"a": 256, "b": 100}
    assert await index.longest_prefix(MODEL, chain(256, "tenant-z")) == {}
    assert index.round_trips - before == 2
    assert guard.stats.command_errors == 0


async def test_pipelined_lookup_round_trips_are_bounded(redis, guard):
    h = chain(256)
    chunked = RedisPageIndex(redis, guard=guard, chunk_pages=64, server_side=False)
    await chunked.publish(MODEL, "a", h)
    before = chunked.round_trips
    assert await chunked.longest_prefix(MODEL, h) == {"a": 256}
    assert chunked.round_trips - before == 4
    assert await chunked.longest_prefix(MODEL, chain(256, "tenant-z")) == {}
    assert chunked.round_trips - before == 5  # a miss stops after the first chunk


@pytest.mark.parametrize("server_side", [True, False])
async def test_ttl_set_on_publish_and_refreshed_on_lookup(redis, guard, server_side):
    index = RedisPageIndex(redis, guard=guard, ttl_s=300, server_side=server_side)
    h = chain(3)
    await index.publish(MODEL, "a", h)
    key = KeySpace().idx(MODEL, h[0])
    assert 290_000 < await redis.pttl(key) <= 300_000
    await redis.pexpire(key, 1_000)
    await index.longest_prefix(MODEL, h)
    assert await redis.pttl(key) > 290_000


async def test_cluster_keeps_one_models_index_on_one_slot(redis, redis_kind):
    if redis_kind != "cluster":
        pytest.skip("slots exist only on a cluster")
    keys = KeySpace()
    slots = {await redis.cluster_keyslot(keys.idx(MODEL, h)) for h in chain(50)}
    assert len(slots) == 1
    page_slots = {await redis.cluster_keyslot(keys.page(h)) for h in chain(50)}
    assert len(page_slots) > 1  # page bytes spread over the cluster


async def test_in_memory_index_ttl():
    clock = FakeClock()
    index = InMemoryPageIndex(ttl_s=10, clock=clock)
    h = chain(4)
    await index.publish(MODEL, "a", h)
    clock.now += 8
    assert await index.longest_prefix(MODEL, h[:2]) == {"a": 2}  # refreshes pages 0 and 1 only
    clock.now += 8
    assert await index.longest_prefix(MODEL, h) == {"a": 2}
    clock.now += 11
    assert await index.longest_prefix(MODEL, h) == {}
    assert index.round_trips == 0


class FlakyStore(PageStore):
    """Acknowledges only even-numbered writes; a stand-in for a tier that drops some writes."""

    def __init__(self) -> None:
        self.inner = HostPageStore(1 << 20)

    async def get_many(self, keys):
        return await self.inner.get_many(keys)

    async def put_many(self, items):
        return [i % 2 == 0 and self.inner.put(k, b) for i, (k, b) in enumerate(items)]

    async def delete_many(self, keys):
        await self.inner.delete_many(keys)


async def test_publish_only_after_ack(make_index):
    index = make_index()
    h = chain(6)
    acks = await store_and_publish(FlakyStore(), index, MODEL, "a", [(x, b"blob") for x in h])
    assert acks == [True, False, True, False, True, False]
    assert await index.longest_prefix(MODEL, h) == {"a": 1}
    assert await index.longest_prefix(MODEL, h[2:]) == {"a": 1}
    assert await index.longest_prefix(MODEL, h[1:]) == {}


async def test_publish_only_after_ack_with_a_full_redis():
    """A real server refusing writes (maxmemory + noeviction): refused pages are never indexed."""
    from edgeinfer.cache_store.resilience import RedisGuard, redis_client

    with ValkeyServer(maxmemory="3mb", maxmemory_policy="noeviction") as server:
        client = redis_client(server.url)
        try:
            store = RedisPageStore(client, guard=RedisGuard(timeout_s=2.0))
            index = InMemoryPageIndex()
            h = chain(12)
            acks = await store_and_publish(store, index, MODEL, "a", [(x, b"\xab" * 400_000) for x in h])
            assert 0 < sum(acks) < 12, acks
            for page, ok in zip(h, acks, strict=True):
                assert await index.longest_prefix(MODEL, [page]) == ({"a": 1} if ok else {})
            assert store.guard.stats.command_errors == 0 and store.guard.stats.errors == 0
        finally:
            await client.aclose()
