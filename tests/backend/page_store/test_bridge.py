"""The shared KV page store wired into the backend (backend/page_store/bridge.py), on the real SmolLM2 model and a
real valkey-server.

- two backend processes: a prompt prefilled on A is served by B from the store, output identical to cold;
- Redis killed mid-load: both keep answering; caching resumes once Redis is back; drain publishes hot pages;
- in-process: >= 200 pages bit-flipped in the host tier and in Redis are all detected, counted, deleted and
  recomputed; the KV that does reach the pool is byte-identical to the pristine pages.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import msgspec
import pytest
import requests

from edgeinfer.cache_store.codec import ENVELOPE_BYTES, TAG_BYTES, DecodedPage, PageKey, decode
from edgeinfer.protocol.page_id import PageKeyContext, page_hashes
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams
from tests.conftest import wait_until
from tests.support.backend_process import INTERNAL_AUTH, INTERNAL_SECRET, BackendProcess

pytestmark = pytest.mark.slow
SEED = "page-store-test-seed"
OPERATOR_KEY = "op-key-for-tests"
VOCAB_LO, VOCAB_HI = 100, 40000


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


class Backend(BackendProcess):
    def __init__(self, model_dir, node_id: str, redis_url: str, log_dir: Path) -> None:
        super().__init__(model_dir, node_id, ["--redis-url", redis_url, "--num-pages", "400", "--max-num-seqs", "4",
                                              "--heartbeat", "0.5", "--operator-key", OPERATOR_KEY,
                                              "--store-fetch-timeout", "3"], SEED, log_dir / f"{node_id}.log")

    def published(self) -> float:
        return self.metric("edgeinfer_backend_page_store_pages_total", event="published")

    def generate(self, prompt: list[int], namespace: str, max_tokens: int = 8, **extra) -> tuple[list[int], dict]:
        ids, last = super().generate(prompt, namespace, max_tokens, **extra)
        assert last.finish_reason == "length", last
        return ids, msgspec.to_builtins(last.usage)


@pytest.fixture(scope="module")
def nodes(smol_dir, valkey, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("backends")
    pair = [Backend(smol_dir, "store-a", valkey.url, log_dir), Backend(smol_dir, "store-b", valkey.url, log_dir)]
    try:
        for b in pair:
            b.wait_ready()
        yield pair
    finally:
        for b in pair:
            b.stop()


async def _redis_view(url: str, model: str, hashes: list[bytes]) -> tuple[dict, list]:
    from edgeinfer.cache_store.index import RedisPageIndex
    from edgeinfer.cache_store.registry import RedisNodeRegistry
    from edgeinfer.cache_store.resilience import RedisGuard, redis_client

    client = redis_client(url)
    try:
        guard = RedisGuard(timeout_s=5)
        held = await RedisPageIndex(client, guard=guard).longest_prefix(model, hashes)
        listed = await RedisNodeRegistry(client, guard=guard).list_nodes(model)
        return held, listed
    finally:
        await client.aclose()


def test_prompt_prefilled_on_a_is_served_by_b_from_the_store(nodes, valkey):
    a, b = nodes
    prompt = random_prompt(1, 1024)
    base = a.published()
    out_a, usage_a = a.generate(prompt, "tenant-1")
    assert usage_a["cached_tokens"] == 0
    wait_until(lambda: a.published() >= base + 64, 30, 0.1, what="A publishes the prompt's 64 pages")
    out_b, usage_b = b.generate(prompt, "tenant-1")
    assert usage_b["cached_tokens"] >= 1008, usage_b
    cold, usage_cold = b.generate(prompt, "tenant-fresh")       # other namespace: nothing shared
    assert usage_cold["cached_tokens"] == 0
    assert out_b == cold == out_a
    assert b.metric("edgeinfer_backend_page_store_pages_total", event="uploaded") >= 63
    assert b.metric("edgeinfer_backend_integrity_failures_total") == 0

    info = requests.get(a.url + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()
    ctx = PageKeyContext(SEED.encode(), "tenant-1", info["model_fingerprint"], info["kv_format"], info["page_size"])
    hashes = page_hashes(ctx, prompt)

    def indexed():
        held, _ = asyncio.run(_redis_view(valkey.url, info["model"], hashes))
        return held.get("store-a", 0) == 64 and held.get("store-b", 0) >= 63

    wait_until(indexed, 10, 0.1, what="index lists A (64 pages) and B (63 fetched pages)")
    _, listed = asyncio.run(_redis_view(valkey.url, info["model"], hashes))
    assert {r.node_id: (r.url, r.state) for r in listed} == {"store-a": (a.url, "active"),
                                                             "store-b": (b.url, "active")}


def test_backends_sign_their_registry_records_with_the_internal_secret(nodes, valkey):
    """A real backend's heartbeat writes a record the gateway verifies (cache_store.node_auth)."""
    from edgeinfer.cache_store.node_auth import NodeRecordKey
    from edgeinfer.cache_store.registry import RedisNodeRegistry
    from edgeinfer.cache_store.resilience import redis_client

    async def listing() -> list:
        client = redis_client(valkey.url)
        try:
            return await RedisNodeRegistry(client).list_nodes()
        finally:
            await client.aclose()

    listed = asyncio.run(listing())
    assert {r.node_id for r in listed} >= {"store-a", "store-b"}
    for r in listed:
        assert NodeRecordKey(INTERNAL_SECRET).refusal(r) is None, r
        assert NodeRecordKey("not-this-deployments-secret").refusal(r) == "bad_signature"


def test_redis_killed_mid_load_backends_keep_answering_and_resume_caching(nodes, valkey):
    a, b = nodes
    results, errors = [], []

    def load() -> None:
        for i in range(8):
            node = (a, b)[i % 2]
            try:
                t = time.monotonic()
                ids, usage = node.generate(random_prompt(100 + i, 96), f"load-{i}", max_tokens=4)
                results.append((len(ids), time.monotonic() - t))
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    worker = threading.Thread(target=load)
    worker.start()
    wait_until(lambda: len(results) + len(errors) >= 2, 60, 0.1, what="first requests of the load")
    valkey.kill()
    worker.join(timeout=120)
    assert not errors and len(results) == 8 and all(n == 4 for n, _ in results), (errors, results)
    assert max(dt for _, dt in results) < 20
    # still serving with Redis down
    ids, usage = a.generate(random_prompt(200, 64), "down", max_tokens=4)
    assert len(ids) == 4 and requests.get(b.url + "/health", timeout=5).status_code == 200

    valkey.start()                                  # same port, empty
    deadline = time.monotonic() + 60
    attempt = 0
    while True:       # the guard lets a probe through within its backoff (<= 5 s); until then: no caching
        attempt += 1
        prompt = random_prompt(300 + attempt, 300)
        base = a.published()
        a.generate(prompt, "after-restart", max_tokens=4)
        wait_until(lambda base=base: a.published() >= base + 18, 10, 0.1, what="A publishes (to the host tier at least)")
        _, usage = b.generate(prompt, "after-restart", max_tokens=4)
        if usage["cached_tokens"] >= 288:
            break
        assert usage["cached_tokens"] == 0, usage
        assert time.monotonic() < deadline, "caching across nodes did not resume after Redis came back"


def test_drain_publishes_hot_pages_and_marks_node_draining(nodes, valkey):
    """After the restart Redis is empty; B's pool still holds tenant-fresh's pages from the first test."""
    a, b = nodes
    prompt = random_prompt(1, 1024)
    auth = {"authorization": f"Bearer {OPERATOR_KEY}"}
    base = b.published()
    r = requests.post(b.url + "/admin/drain", headers=auth, timeout=60)
    assert r.status_code == 200
    assert b.published() >= base + 63
    info = requests.get(b.url + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()
    _, listed = asyncio.run(_redis_view(valkey.url, info["model"], []))
    assert {rec.node_id: rec.state for rec in listed}.get("store-b") == "draining"
    out, usage = a.generate(prompt, "tenant-fresh")
    assert usage["cached_tokens"] >= 1008, usage
    ref, _ = a.generate(prompt, "tenant-1")          # A's own (local) copy of the same tokens
    assert out == ref
    assert requests.post(b.url + "/admin/undrain", headers=auth, timeout=10).status_code == 200


# ---------------------------------------------------------------------------------------------------- in-process

def corrupt(blob: bytes, rng: random.Random, region: str) -> bytes:
    """Flip 1-8 distinct random bits inside one region of a page frame."""
    header_len = int.from_bytes(blob[8:12], "little")
    lo, hi = {"envelope": (0, ENVELOPE_BYTES), "header": (ENVELOPE_BYTES, ENVELOPE_BYTES + header_len),
              "body": (ENVELOPE_BYTES + header_len, len(blob) - TAG_BYTES), "tag": (len(blob) - TAG_BYTES, len(blob)),
              "anywhere": (0, len(blob))}[region]
    out = bytearray(blob)
    for bit in rng.sample(range(lo * 8, hi * 8), rng.randint(1, 8)):
        out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


REGIONS = ["envelope", "header", "header", "body", "body", "tag", "anywhere"]


async def _generate(engine, bridge, prompt, namespace, max_tokens=8):
    req = GenerateRequest(f"r{time.monotonic_ns()}", prompt,
                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), namespace)
    await bridge.before_generate(None, req)
    ids, usage = [], None
    async for ch in engine.generate(req):
        ids += ch.token_ids
        usage = ch.usage or usage
    return ids, usage


async def test_corrupted_pages_in_host_and_redis_are_all_detected_and_never_used(smol_dir, valkey, caplog):
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine
    from edgeinfer.backend.metrics import BackendMetrics
    from edgeinfer.backend.page_store.bridge import PageStoreBridge
    caplog.set_level("WARNING", logger="edgeinfer.store_bridge")
    from edgeinfer.cache_store.index import RedisPageIndex
    from edgeinfer.cache_store.resilience import RedisGuard, redis_client
    from edgeinfer.cache_store.store import HostPageStore, RedisPageStore, TieredPageStore

    if valkey.proc is None:
        valkey.start()
    engine = load_engine(smol_dir, EngineConfig(num_pages=300, cache_seed=b"corruption-test"))
    engine.start()
    client = redis_client(valkey.url, socket_timeout_s=5)
    guard = RedisGuard(timeout_s=5)
    host = HostPageStore(1 << 30)
    redis_store = RedisPageStore(client, guard=guard, timeout_s=5)
    metrics = BackendMetrics(engine.model_name)
    bridge = PageStoreBridge(engine, node_id="inproc", store=TieredPageStore([("host", host), ("redis", redis_store)]),
                             page_key=PageKey.from_secret(b"corruption-test-page-key"),
                             index=RedisPageIndex(client, guard=guard), metrics=metrics, redis_client=client,
                             fetch_timeout_s=30, fetch_chunk_bytes=4 * engine.runner.page_bytes)
    await bridge.start()
    try:
        count = lambda src: metrics.registry.get_sample_value(  # noqa: E731
            "edgeinfer_backend_integrity_failures_total", {"model": engine.model_name, "source": src}) or 0.0
        prompt = random_prompt(7, 1650)
        ns = "corrupt-ns"
        ref, usage = await _generate(engine, bridge, prompt, ns)       # cold run: the reference output
        assert usage.cached_tokens == 0
        assert await bridge.flush(30)
        ctx = engine.key_context(ns)
        hashes = page_hashes(ctx, prompt[: (len(prompt) - 1) // 16 * 16])
        n = len(hashes)
        assert n == 103
        pristine = {h: host.get(h) for h in hashes}
        assert all(pristine.values()) and all(await redis_store.get_many(hashes))
        blocks = engine.blocks

        async def drop_local() -> None:
            await engine.call_in_engine(lambda: [blocks.drop_cached(h) for h in hashes])

        def local_pages() -> int:
            return blocks.cached_prefix_len(hashes, prompt, ctx.root)

        rng = random.Random(11)
        regions: dict[str, int] = {}

        def bad(h: bytes) -> bytes:
            region = rng.choice(REGIONS)
            regions[region] = regions.get(region, 0) + 1
            return corrupt(pristine[h], rng, region)

        req = GenerateRequest("probe", prompt, SamplingParams(max_tokens=1, temperature=0.0), ns)
        corrupted = 0
        # host phase: every host copy corrupted, Redis intact. Each fetch uploads the page before the first
        # corrupt one (from Redis, whose copy is good), hits the corrupt one, counts and deletes it.
        await drop_local()
        for h in hashes:
            host.put(h, bad(h))
            corrupted += 1
        for j in range(n):
            before = count("host")
            await bridge.prefetch(req)
            assert count("host") == before + 1, f"page {j}: host corruption not detected"
            assert hashes[j] not in host
            assert local_pages() == j                 # nothing at or after the corrupt page was used
        assert await bridge.prefetch(req) > 0 and local_pages() == n
        # redis phase: host empty, every Redis copy corrupted in place; after each detection the good page is
        # republished to the host tier (as a peer would), so the next fetch reaches the next corrupt page.
        await drop_local()
        assert len(host) == 0
        for h in hashes:
            await client.set(redis_store.keys.page(h), bad(h), keepttl=True)
            corrupted += 1
        for j in range(n):
            before = count("redis")
            await bridge.prefetch(req)
            assert count("redis") == before + 1, f"page {j}: redis corruption not detected"
            assert await client.exists(redis_store.keys.page(hashes[j])) == 0
            assert local_pages() == j
            host.put(hashes[j], pristine[hashes[j]])
        assert corrupted >= 200 and count("host") + count("redis") == corrupted == bridge.stats.integrity_failures
        assert all(regions.get(r, 0) > 0 for r in set(REGIONS)), regions
        # what reached the KV pool is exactly the pristine pages
        await engine.call_in_engine(lambda: None)
        pages = [blocks.cache[h].page for h in hashes[: n - 1]]
        rows = await engine.call_in_engine(engine.runner.page_io.read, pages)
        for h, row in zip(hashes, rows, strict=False):
            body = decode(pristine[h], bridge.format.expect(h, blocks.cache[h].parent, list(blocks.cache[h].tokens)),
                          bridge.page_key)
            assert isinstance(body, DecodedPage) and row.numpy().tobytes() == bytes(body.body)
        out, usage = await _generate(engine, bridge, prompt, ns)
        assert out == ref and usage.cached_tokens == n * 16
        # a store corrupted past page 60 (page 60: a valid page of another position, i.e. a forged key):
        # 60 pages come from the store, the rest is recomputed, the output is the cold one
        await drop_local()
        host.put(hashes[60], pristine[hashes[61]])
        for h in hashes[61:]:
            host.put(h, bad(h))
        before = count("host")
        out, usage = await _generate(engine, bridge, prompt, ns)
        assert count("host") == before + 1 and usage.cached_tokens == 60 * 16
        assert out == ref
        assert any(hashes[60].hex() in r.getMessage() and "host tier" in r.getMessage()
                   and "hash_mismatch" in r.getMessage() for r in caplog.records)
        # the body layout is read_page's parts, concatenated; gather/scatter round-trip through the pool
        import torch

        page = blocks.cache[hashes[0]].page
        parts = await engine.call_in_engine(engine.runner.read_page, page)
        row = (await engine.call_in_engine(engine.runner.page_io.read, [page]))[0]
        assert torch.equal(row, torch.cat([t.reshape(-1).view(torch.uint8) for t in parts]))
    finally:
        await bridge.stop()
        engine.stop()


async def test_pages_the_engine_evicts_leave_the_index(smol_dir, valkey):
    """The gateway routes a prefix to the nodes the index lists; once this node's engine evicts those pages
    it must stop being listed (not wait for the index TTL), and a page cached again must stay listed."""
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine
    from edgeinfer.backend.page_store.bridge import PageStoreBridge
    from edgeinfer.cache_store.index import RedisPageIndex
    from edgeinfer.cache_store.resilience import RedisGuard, redis_client
    from edgeinfer.cache_store.store import HostPageStore, TieredPageStore

    if valkey.proc is None:
        valkey.start()
    engine = load_engine(smol_dir, EngineConfig(num_pages=24, cache_seed=b"unindex-test"))
    engine.start()
    client = redis_client(valkey.url, socket_timeout_s=5)
    index = RedisPageIndex(client, guard=RedisGuard(timeout_s=5))
    bridge = PageStoreBridge(engine, node_id="evictor", store=TieredPageStore([("host", HostPageStore(1 << 30))]),
                             page_key=PageKey.from_secret(b"unindex-test-page-key"),
                             index=index, redis_client=client, unindex_interval_s=3600)   # driven by hand below
    await bridge.start()
    try:
        ns = "unindex-ns"
        first = random_prompt(21, 8 * 16 + 1)
        await _generate(engine, bridge, first, ns)
        assert await bridge.flush(30)
        hashes = page_hashes(engine.key_context(ns), first[:128])
        assert await index.longest_prefix(engine.model_name, hashes) == {"evictor": 8}
        assert await bridge.unindex_evicted() == 0              # nothing evicted yet: the entries stay
        for seed in (22, 23, 24):                                # 3 x 10 pages through a 24-page pool
            await _generate(engine, bridge, random_prompt(seed, 9 * 16 + 1), ns)
        await engine.call_in_engine(lambda: None)
        evicted = [h for h in hashes if h not in engine.blocks.cache]
        assert evicted, "the pool was large enough to keep every page: the test proves nothing"
        removed = await bridge.unindex_evicted()
        assert removed >= len(evicted) and bridge.stats.unindexed == removed
        listed = await index.longest_prefix(engine.model_name, hashes)
        assert listed.get("evictor", 0) == next(i for i, h in enumerate(hashes) if h not in engine.blocks.cache)
        # recompute the first prompt: its pages are published and listed again
        await _generate(engine, bridge, first, ns)
        assert await bridge.flush(30)
        await bridge.unindex_evicted()
        assert await index.longest_prefix(engine.model_name, hashes) == {"evictor": 8}
    finally:
        await bridge.stop()
        engine.stop()
