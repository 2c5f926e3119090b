"""Quantized KV (issue 40, item 3; int8 in issue 55): a request gives the same greedy tokens and the same logprob
bits whether its prefix came from the local prefix cache, the host tier, another node's pages through the store
(valkey), or a cold prefill. The served default model (native INT4: row-invariant int8 GEMMs), int8 pages (what
the gate serves on it), fp8 and bf16 pages, the real page store.

Why it can hold: prefill rows attend to K/V as stored (quantized), and each row is computed alone
(kernels/cpu/attn.cpp prefill_attention), so the rows after a cached prefix do not depend on the chunk they
come in; a cold prefill (split by the token budget) and a suffix after a hit give the same bits. With SDPA's
32-row blocks (before), a chunk leaving a block of 1-3 rows changed their bits, and fp8 rounding amplified it
into different tokens (docs/QUANTIZATION.md)."""

from __future__ import annotations

import random
import time

import pytest

from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow
NS = "tenant:invariance"
BUDGET = 512          # the engine's prefill token budget: a cold 833-token prompt is prefilled as 512 + 321 rows


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def native_dir():
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model

    return ensure_native_default_model()


def engine(native_dir, seed: bytes, kv: str):
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine

    eng = load_engine(native_dir, EngineConfig(kv_dtype=kv, num_pages=300, cache_seed=seed,
                                               max_num_batched_tokens=BUDGET))
    eng.start()
    return eng


async def run(eng, prompt: list[int], bridge=None, tokens: int = 12):
    req = GenerateRequest(f"inv-{time.monotonic_ns()}", prompt,
                          SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=True), NS)
    if bridge is not None:
        await bridge.before_generate(None, req)
    ids, lps, usage = [], [], None
    async for ch in eng.generate(req):
        ids += ch.token_ids
        lps += [lp.logprob for lp in ch.logprobs or []]
        usage = ch.usage or usage
    return ids, lps, usage


def bridge_for(eng, node_id: str, client, host=None):
    from edgeinfer.backend.metrics import BackendMetrics
    from edgeinfer.backend.page_store.bridge import PageStoreBridge
    from edgeinfer.cache_store.codec import PageKey
    from edgeinfer.cache_store.index import RedisPageIndex
    from edgeinfer.cache_store.resilience import RedisGuard
    from edgeinfer.cache_store.store import RedisPageStore, TieredPageStore

    guard = RedisGuard(timeout_s=5)
    tiers = ([("host", host)] if host is not None else []) + [("redis", RedisPageStore(client, guard=guard,
                                                                                       timeout_s=5))]
    return PageStoreBridge(eng, node_id=node_id, store=TieredPageStore(tiers),
                           page_key=PageKey.from_secret(b"invariance-page-key"), index=RedisPageIndex(client, guard=guard),
                           metrics=BackendMetrics(eng.model_name), redis_client=client, fetch_timeout_s=30,
                           fetch_chunk_bytes=4 * eng.runner.page_bytes)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "bf16"])   # every format the gate may serve
async def test_greedy_output_is_the_same_from_every_source_of_its_prefix(native_dir, valkey, kv):
    from edgeinfer.cache_store.resilience import redis_client
    from edgeinfer.cache_store.store import HostPageStore
    from edgeinfer.protocol.page_id import page_hashes

    if valkey.proc is None:
        valkey.start()
    seed = f"{kv}-invariance-seed".encode()
    prefix = prompt_of(1, 800)                         # 50 full pages
    probe = prefix + prompt_of(2, 33)                  # after a hit: one 33-row chunk (a 1-row SDPA block)
    cold_eng = engine(native_dir, seed, kv)
    a = engine(native_dir, seed, kv)
    b = engine(native_dir, seed, kv)
    client = redis_client(valkey.url, socket_timeout_s=5)
    host = HostPageStore(1 << 30)
    bridge_a, bridge_b = bridge_for(a, "inv-a", client, host), bridge_for(b, "inv-b", client)
    await bridge_a.start()
    await bridge_b.start()
    try:
        cold, cold_lp, u = await run(cold_eng, probe)              # prefilled as 512 + 321 rows
        assert u.cached_tokens == 0 and len(cold) == 12
        # local prefix cache: another request with the same prefix fills it, then the probe hits it
        _, _, u = await run(a, prefix + prompt_of(3, 100), bridge_a)
        assert u.cached_tokens == 0
        local, local_lp, u = await run(a, probe, bridge_a)
        assert u.cached_tokens == 800, u
        assert (local, local_lp) == (cold, cold_lp)
        # host tier: the engine's own copies dropped, the pages swapped in from host memory
        assert await bridge_a.flush(30)
        hashes = page_hashes(a.key_context(NS), probe)
        assert all(h in host for h in hashes)
        await a.call_in_engine(lambda: [a.blocks.drop_cached(h) for h in hashes])
        from_host, host_lp, u = await run(a, probe, bridge_a)
        assert u.cached_tokens >= 800, u      # the probe's own 52 pages were published too: 832
        assert (from_host, host_lp) == (cold, cold_lp)
        # another node: B has never seen the prefix; it fetches A's pages from valkey
        from_b, b_lp, u = await run(b, probe, bridge_b)
        assert u.cached_tokens >= 800, u
        assert (from_b, b_lp) == (cold, cold_lp)
    finally:
        await bridge_a.stop()
        await bridge_b.stop()
        await client.aclose()
        for e in (cold_eng, a, b):
            e.stop()
