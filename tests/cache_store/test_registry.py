import asyncio
import time

import msgspec
import pytest

from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.cache_store.registry import (
    InMemoryNodeRegistry,
    NodeRecord,
    RedisNodeRegistry,
    keep_registered,
)
from edgeinfer.cache_store.resilience import RedisGuard, redis_client
from tests.support.redis_server import ValkeyServer, command


def record(node_id: str, model: str = "smollm2-135m", **kw) -> NodeRecord:
    return NodeRecord(node_id=node_id, url=f"http://10.0.0.1:{8000 + len(node_id)}", model=model,
                      version="0.1.0", started_at=1.7e9, **kw)


@pytest.fixture(params=["redis", "memory"])
def make_registry(request, redis_kind):
    if request.param == "memory":
        if redis_kind == "cluster":
            pytest.skip("in-memory registry has no cluster variant")
        return lambda **kw: InMemoryNodeRegistry(**kw)
    redis = request.getfixturevalue("redis")
    guard = request.getfixturevalue("guard")
    return lambda **kw: RedisNodeRegistry(redis, guard=guard, **kw)


async def test_register_list_filter_deregister(make_registry):
    reg = make_registry()
    assert await reg.register(record("n1"))
    assert await reg.register(record("n2", model="llama-1b"))
    assert await reg.register(record("n3", state="draining", running=3, waiting=1, kv_usage=0.5))
    nodes = await reg.list_nodes()
    assert [n.node_id for n in nodes] == ["n1", "n2", "n3"]
    assert all(n.updated_at > 0 for n in nodes)
    assert [n.node_id for n in await reg.list_nodes("smollm2-135m")] == ["n1", "n3"]
    n3 = (await reg.list_nodes("smollm2-135m"))[1]
    assert (n3.state, n3.running, n3.waiting, n3.kv_usage) == ("draining", 3, 1, 0.5)
    assert await reg.deregister("n1")
    assert [n.node_id for n in await reg.list_nodes()] == ["n2", "n3"]


async def test_heartbeat_replaces_record(make_registry):
    reg = make_registry()
    await reg.register(record("n1"))
    await reg.heartbeat(record("n1", running=7, cache_hit_rate=0.25))
    (n1,) = await reg.list_nodes()
    assert (n1.running, n1.cache_hit_rate) == (7, 0.25)


async def test_ttl_is_three_heartbeats(redis, guard):
    reg = RedisNodeRegistry(redis, heartbeat_s=5, guard=guard)
    await reg.register(record("n1"))
    assert 14_000 < await redis.pttl(KeySpace().node("n1")) <= 15_000
    raw = await redis.get(KeySpace().node("n1"))
    assert msgspec.json.decode(raw)["url"] == record("n1").url


async def test_silent_node_expires_and_is_pruned(redis, guard):
    reg = RedisNodeRegistry(redis, heartbeat_s=0.1, guard=guard)
    await reg.register(record("quiet"))
    await reg.register(record("alive"))
    await asyncio.sleep(0.2)
    await reg.heartbeat(record("alive"))
    await asyncio.sleep(0.15)
    assert [n.node_id for n in await reg.list_nodes()] == ["alive"]
    assert await redis.smembers(KeySpace().nodes) == {b"alive"}


async def test_in_memory_expiry():
    now = [0.0]
    reg = InMemoryNodeRegistry(heartbeat_s=1, clock=lambda: now[0])
    await reg.register(record("n1"))
    now[0] = 2.9
    assert len(await reg.list_nodes()) == 1
    now[0] = 3.0
    assert await reg.list_nodes() == []


def test_invalid_ids_rejected():
    with pytest.raises(ValueError, match="node id 'a b'"):
        KeySpace().node("a b")
    with pytest.raises(ValueError, match="model 'x{y}'"):
        KeySpace().idx("x{y}", b"\0" * 16)


async def test_heartbeat_puts_the_whole_record_back_soon_after_redis_restarts_empty():
    """Redis down for 3 s trips the shared breaker (backed off to 2 s, so a plain call would be skipped
    until then); once an empty Redis is back on the port, the next beat, forced through the breaker,
    writes the whole record and the set entry: listed again in well under two beats."""
    beat = 0.4
    server = ValkeyServer().start()
    client = redis_client(server.url)
    reg = RedisNodeRegistry(client, heartbeat_s=beat, guard=RedisGuard(timeout_s=0.5))
    beats = asyncio.create_task(keep_registered(reg, lambda: record("n1", running=2),
                                                landed=await reg.register(record("n1", running=2))))
    try:
        await asyncio.sleep(beat)
        server.kill()
        await asyncio.sleep(3.0)
        assert reg.guard.is_open or reg.guard.stats.trips >= 1
        await asyncio.to_thread(server.start)   # same port, nothing in it
        back = time.monotonic()
        while not await asyncio.to_thread(command, server.port, "EXISTS", KeySpace().node("n1")) == b":1\r\n":
            assert time.monotonic() - back < 10, "the node never came back"
            await asyncio.sleep(0.01)
        took = time.monotonic() - back
        assert took < 2 * beat, f"listed again {took:.2f}s after Redis came back (beat {beat}s)"
        print(f"\nlisted again {took:.3f}s after an empty Redis came back (beat {beat}s)")
        (n1,) = await reg.list_nodes()
        assert (n1.node_id, n1.url, n1.running, n1.started_at) == ("n1", record("n1").url, 2, 1.7e9)
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
        await client.aclose()
        server.stop()


SECRET = "node-registry-test-internal-secret"


async def test_signed_heartbeat_is_verified_and_every_field_is_covered(redis, guard):
    from edgeinfer.cache_store.node_auth import NodeRecordKey

    key = NodeRecordKey(SECRET, clock_skew_s=0.0)
    reg = RedisNodeRegistry(redis, heartbeat_s=5, guard=guard, signer=key)
    await reg.register(record("n1", running=2))
    (n1,) = await reg.list_nodes()
    assert n1.sig and n1.expires_at == pytest.approx(n1.updated_at + 15)
    assert key.refusal(n1) is None
    assert NodeRecordKey("another-deployment-secret").refusal(n1) == "bad_signature"
    assert key.refusal(msgspec.structs.replace(n1, sig="")) == "unsigned"
    changes = {"node_id": "n2", "url": "http://10.6.6.6:8000", "model": "other", "version": "9", "state": "draining",
               "running": 0, "waiting": 5, "kv_usage": 0.9, "cache_hit_rate": 0.5, "started_at": 1.0,
               "updated_at": n1.updated_at + 3600, "expires_at": n1.expires_at + 3600, "role": "prefill"}
    assert set(changes) | {"sig"} == set(NodeRecord.__struct_fields__)
    for name, value in changes.items():
        assert key.refusal(msgspec.structs.replace(n1, **{name: value})) == "bad_signature", name
    assert key.refusal(n1, now=n1.expires_at) is None
    assert key.refusal(n1, now=n1.expires_at + 0.01) == "expired"
    assert NodeRecordKey(SECRET, clock_skew_s=5.0).refusal(n1, now=n1.expires_at + 4.9) is None


async def test_unsigned_registry_writes_unsigned_records(redis, guard):
    reg = RedisNodeRegistry(redis, heartbeat_s=5, guard=guard)
    await reg.register(record("n1"))
    (n1,) = await reg.list_nodes()
    assert (n1.sig, n1.expires_at) == ("", 0.0)


def test_a_nodes_role_is_signed_and_a_record_without_one_signs_as_before():
    from edgeinfer.cache_store.node_auth import NodeRecordKey, _canonical
    from edgeinfer.cache_store.registry import NodeRecord

    key = NodeRecordKey("registry-role-test-secret-0123456789")
    plain = NodeRecord("n1", "http://127.0.0.1:1", "m", "1", updated_at=time.time())
    assert b'"both"' not in _canonical(plain)     # the canonical form of a --role both node is the old one
    signed = key.sign(msgspec.structs.replace(plain, role="prefill"), ttl_s=60)
    assert key.refusal(signed) is None
    assert key.refusal(msgspec.structs.replace(signed, role="decode")) == "bad_signature"
    assert key.refusal(msgspec.structs.replace(signed, role="both")) == "bad_signature"
