"""Fixtures: a real valkey-server and a real 3-node valkey cluster per test session, flushed per test."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgeinfer.cache_store.resilience import RedisGuard, redis_client  # noqa: E402
from tests.support.redis_server import ValkeyCluster, ValkeyServer  # noqa: E402


@pytest.fixture(scope="session")
def valkey_single() -> Iterator[ValkeyServer]:
    with ValkeyServer() as server:
        yield server


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    with ValkeyCluster(3) as cluster:
        yield cluster


@pytest.fixture(params=["single", "cluster"])
def redis_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def redis(redis_kind: str, request: pytest.FixtureRequest) -> AsyncIterator[object]:
    """redis.asyncio.Redis or RedisCluster on a flushed real server."""
    if redis_kind == "cluster":
        from redis.asyncio.cluster import RedisCluster

        server = request.getfixturevalue("valkey_cluster")
        client = redis_client(server.url, cluster=True)
        await client.initialize()
        await client.flushall(target_nodes=RedisCluster.PRIMARIES)
    else:
        server = request.getfixturevalue("valkey_single")
        client = redis_client(server.url)
        await client.flushall()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def guard() -> RedisGuard:
    """Generous timeout: the test machine is small and shared; resilience tests build their own."""
    return RedisGuard(timeout_s=2.0)
