"""Redis killed or paused mid-test: calls answer misses fast, never raise, and recover."""

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from edgeinfer.cache_store.index import RedisPageIndex
from edgeinfer.cache_store.registry import NodeRecord, RedisNodeRegistry
from edgeinfer.cache_store.resilience import RedisGuard, redis_client
from edgeinfer.cache_store.store import RedisPageStore
from tests.support.redis_server import ValkeyServer, command

H = [bytes([i]) * 16 for i in range(8)]
NODE = NodeRecord(node_id="n1", url="http://n1", model="m", version="1")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_breaker_opens_backs_off_and_closes():
    clock = Clock()
    guard = RedisGuard(timeout_s=1, backoff_s=1, max_backoff_s=4, clock=clock)
    calls = []

    async def failing():
        calls.append(1)
        raise RedisConnectionError("down")

    async def ok():
        calls.append(1)
        return "ok"

    assert await guard.run(failing, "miss", "t") == "miss" and guard.is_open
    assert await guard.run(ok, "miss", "t") == "miss" and len(calls) == 1  # skipped, no I/O
    clock.now = 1.0
    assert await guard.run(failing, "miss", "t") == "miss"  # probe fails: backoff doubles
    clock.now = 2.5
    assert await guard.run(ok, "miss", "t") == "miss"
    clock.now = 3.0
    assert await guard.run(ok, "miss", "t") == "ok" and not guard.is_open
    assert (guard.stats.errors, guard.stats.skipped, guard.stats.trips, guard.stats.ok) == (2, 2, 1, 1)


async def test_forced_call_runs_through_the_open_breaker_and_only_its_success_counts():
    clock = Clock()
    guard = RedisGuard(timeout_s=1, backoff_s=1, max_backoff_s=4, clock=clock)
    calls = []

    async def failing():
        calls.append(1)
        raise RedisConnectionError("down")

    async def ok():
        calls.append(1)
        return "ok"

    await guard.run(failing, None, "t")
    assert guard.is_open and len(calls) == 1
    assert await guard.run(failing, "miss", "beat", force=True) == "miss" and len(calls) == 2  # ran
    clock.now = 1.0       # the forced failure did not extend the 1 s backoff: a plain call probes now
    assert await guard.run(ok, "miss", "t") == "ok" and not guard.is_open
    await guard.run(failing, None, "t")
    assert guard.is_open
    assert await guard.run(ok, "miss", "beat", force=True) == "ok" and not guard.is_open      # closes it
    assert (guard.stats.errors, guard.stats.trips, guard.stats.skipped) == (3, 2, 0)


async def test_command_errors_are_counted_but_do_not_trip():
    guard = RedisGuard()

    async def wrongtype():
        raise ResponseError("WRONGTYPE")

    assert await guard.run(wrongtype, None, "t") is None
    assert guard.stats.command_errors == 1 and not guard.is_open


async def test_only_one_probe_while_half_open():
    clock = Clock()
    guard = RedisGuard(timeout_s=1, backoff_s=1, clock=clock)
    release = asyncio.Event()

    async def failing():
        raise OSError("refused")

    async def slow_ok():
        await release.wait()
        return "ok"

    await guard.run(failing, None, "t")
    clock.now = 2.0
    probe = asyncio.create_task(guard.run(slow_ok, None, "t"))
    await asyncio.sleep(0)
    assert await guard.run(slow_ok, "skipped", "t") == "skipped"
    release.set()
    assert await probe == "ok"


@pytest.fixture
async def live():
    server = ValkeyServer().start()
    client = redis_client(server.url, socket_timeout_s=0.5)
    guard = RedisGuard(timeout_s=0.3, backoff_s=0.2, max_backoff_s=0.4)
    try:
        yield server, client, guard
    finally:
        await client.aclose()
        server.stop()


async def test_redis_killed_then_back_on_the_same_port(live):
    server, client, guard = live
    store = RedisPageStore(client, guard=guard, timeout_s=0.3)
    index = RedisPageIndex(client, guard=guard)
    registry = RedisNodeRegistry(client, guard=guard)
    assert await store.put_many([(h, b"blob") for h in H]) == [True] * 8
    assert await index.publish("m", "n1", H)
    assert await registry.register(NODE)
    assert len(await registry.list_nodes()) == 1

    server.kill()
    start = time.monotonic()
    assert await store.get_many(H) == [None] * 8
    assert await store.put_many([(H[0], b"x")]) == [False]
    assert await index.longest_prefix("m", H) == {}
    assert not await index.publish("m", "n1", H)
    assert not await registry.heartbeat(NODE)
    assert [n.node_id for n in await registry.list_nodes()] == ["n1"]  # last known listing
    assert time.monotonic() - start < 1.0
    assert guard.stats.errors >= 1 and guard.stats.skipped >= 4 and guard.is_open

    server.start()  # a fresh, empty server on the same port
    await asyncio.sleep(0.5)
    assert await store.put_many([(h, b"again") for h in H]) == [True] * 8
    assert await store.get_many(H[:2]) == [b"again"] * 2
    assert await index.publish("m", "n1", H)
    assert await index.longest_prefix("m", H) == {"n1": 8}
    assert not guard.is_open


async def test_paused_redis_times_out_fast(live):
    server, client, guard = live
    store = RedisPageStore(client, guard=guard, timeout_s=0.1)
    await store.put_many([(H[0], b"blob")])
    command(server.port, "CLIENT", "PAUSE", "800", "ALL")
    start = time.monotonic()
    assert await store.get_many([H[0]]) == [None]
    assert time.monotonic() - start < 0.3
    assert guard.stats.timeouts == 1
    assert await store.get_many([H[0]]) == [None] and guard.stats.skipped == 1
    await asyncio.sleep(1.0)
    assert await store.get_many([H[0]]) == [b"blob"]
