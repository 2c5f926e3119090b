"""DeepSeek-V3 / Kimi K2 attention (MLA) over latent pages: the model against transformers' forward on tiny random
checkpoints (fp32 latent pages exactly, fp8 within a stated tolerance), decode reading only the latent, both
prefill forms, the latent pages through the engine (continuous batching, prefix cache) and the page store
(integrity: corrupted latent pages detected and recomputed, never served; a second node hits the first's pages;
a latent page never passes for a GQA page)."""

from __future__ import annotations

import random

import pytest
import torch

from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.loading import load_engine
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.model.mla import MLAAttention
from edgeinfer.cache_store.codec import DecodedPage, Miss, MissReason, PageFormat, PageKey, decode, encode
from edgeinfer.protocol.page_id import PageKeyContext, page_hashes
from tests.support import moe_checkpoints
from tests.support.dense import fresh_kv, greedy, prefill_logits
from tests.support.engine_steps import generate_together

PROMPT = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
# fp8 latent pages vs fp32 on the sharpened tiny model: mean KL(fp32 || fp8) of the next-token distributions over the
# prompt, measured 7.8e-4 (the same model family's GQA fp8 pages: 2.4e-4 GLM-4.5, 2.1e-4 Qwen3-MoE); argmax agreement
FP8_KL_TOL = 2e-3
FP8_ARGMAX_AGREEMENT = 0.9


def hf_run(hf, ids, steps):
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
        out = hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[0, len(ids):]
    return logits, out.tolist()


@pytest.mark.parametrize("case", [
    {"name": "q-lora"},
    {"name": "no-q-lora", "q_lora_rank": None},
    {"name": "yarn-mscale", "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                             "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}},
    {"name": "no-interleave", "rope_interleave": False},
], ids=lambda c: c["name"])
def test_deepseek_v3_matches_transformers_prefill_and_32_greedy_tokens(tmp_path, case):
    case = dict(case)
    case.pop("name")
    hf = moe_checkpoints.build("deepseek_v3", tmp_path, **case)
    ours = load_model(tmp_path)
    attn = ours.layers[0].self_attn
    assert isinstance(attn, MLAAttention) and ours.cfg.num_kv_heads == 1 and ours.cfg.head_dim == 32 + 8
    if "rope_scaling" in case:
        assert abs(attn.scale - hf.model.layers[0].self_attn.scaling) < 1e-9 and attn.scale != 24 ** -0.5
    logits, out = greedy(ours, PROMPT, 32, num_pages=8)
    ref, theirs = hf_run(hf, PROMPT, 32)
    assert (ref - logits).abs().max().item() <= 1e-4
    assert out == theirs


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv3")
    return moe_checkpoints.build("deepseek_v3", d), d


def test_the_pool_holds_only_latent_rows_and_decode_never_expands(dsv3, monkeypatch):
    """Decode reads the latent pages in the absorbed form: with the expanded path and every gather of latents
    into per-head K/V made to fail, decoding still gives transformers' tokens (prefill expands, decode must not)."""
    hf, path = dsv3
    model = load_model(path)
    kv = fresh_kv(model, 8)
    assert kv[0].k.shape[2:] == (1, 40)
    logits = prefill_logits(model, PROMPT, kv)
    table = prefill_logits.table

    def forbidden(*_a, **_k):
        raise AssertionError("decode expanded the latent into per-head K/V")
    for layer in model.layers:
        monkeypatch.setattr(layer.self_attn, "prefill_expanded", forbidden)
        monkeypatch.setattr(layer.self_attn, "prefill_latent", forbidden)
    monkeypatch.setattr("edgeinfer.backend.model.mla.kernels_gather", forbidden)
    from edgeinfer.backend.model.batch import AttentionMetadata

    out, pos = [int(logits[-1].argmax())], len(PROMPT)
    for _ in range(15):
        slot = torch.tensor([int(table[0, pos // 16]) * 16 + pos % 16])
        meta = AttentionMetadata(slot, 1, table, torch.tensor([pos + 1], dtype=torch.int32),
                                 torch.zeros((0, table.shape[1]), dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                 torch.zeros(0, dtype=torch.int32))
        out.append(int(model.compute_logits(model(torch.tensor([out[-1]]), torch.tensor([pos]), kv, meta))[-1].argmax()))
        pos += 1
    assert out == hf_run(hf, PROMPT, 16)[1]


def test_prefill_in_latent_form_equals_the_expanded_form(dsv3):
    _, path = dsv3
    model = load_model(path)
    want = prefill_logits(model, PROMPT, fresh_kv(model, 8))
    for layer in model.layers:
        layer.self_attn.prefill_form = "latent"
    got = prefill_logits(model, PROMPT, fresh_kv(model, 8))
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_quantized_latent_pages_stay_within_the_stated_tolerance(dsv3, qdtype):
    hf, path = dsv3
    model = load_model(path)
    kv = fresh_kv(model, 8)
    fp8 = [type(x)(torch.zeros_like(x.k, dtype=qdtype), None,
                   torch.ones(x.k.shape[:3], dtype=torch.bfloat16), None) for x in kv]
    want = prefill_logits(model, PROMPT, kv)
    got = prefill_logits(model, PROMPT, fp8)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    assert 0 < kl <= FP8_KL_TOL, kl
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= FP8_ARGMAX_AGREEMENT


# ---------------------------------------------------------------- engine and page store

@pytest.fixture(scope="module")
def dsv3_served(smol_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv3-served")
    return moe_checkpoints.servable("deepseek_v3", d, smol_dir, max_position_embeddings=1024), d


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49000, (10 + 15 * i,), generator=g).tolist() for i in range(n)]


def test_engine_batches_latent_pages_and_hits_its_prefix_cache(dsv3_served):
    hf, path = dsv3_served
    eng = load_engine(path, EngineConfig(max_num_batched_tokens=48))
    assert eng.kv_format == "mla_fp32" and eng.runner.bytes_per_token == 3 * 40 * 4   # one latent row a layer
    ps = prompts(3)
    outs = generate_together(eng, ps, "t", [10, 10, 10])
    for p, (ids, _, _) in zip(ps, outs):
        assert ids == hf_run(hf, p, 10)[1]
    again = generate_together(eng, [ps[2]], "t", [10])[0]
    assert again[0] == outs[2][0] and again[2] == 32


def test_latent_page_identity_and_header_never_pass_for_gqa(dsv3_served):
    _, path = dsv3_served
    eng = load_engine(path, EngineConfig(num_pages=16))
    from edgeinfer.backend.page_store.bridge import page_format

    fmt = page_format(eng.kv_port)
    assert (fmt.kv_dtype, fmt.kv_heads, fmt.head_dim, fmt.body_nbytes) == ("mla_fp32", 1, 40, 16 * 3 * 40 * 4)
    ctx = eng.key_context("ns")
    tokens = list(range(100, 132))
    gqa_ctx = PageKeyContext(ctx.seed, "ns", ctx.model_fingerprint, "fp32", ctx.page_size)
    assert page_hashes(ctx, tokens) != page_hashes(gqa_ctx, tokens)
    key = PageKey.from_secret(b"a page key for the mla test")
    h = page_hashes(ctx, tokens)[0]
    blob = encode(fmt.header(h, b"\0" * 16, tokens[:16]), bytes(fmt.body_nbytes), key)
    assert isinstance(decode(blob, fmt.expect(h, b"\0" * 16, tokens[:16]), key), DecodedPage)
    gqa = PageFormat(model_fingerprint=fmt.model_fingerprint, kv_dtype="fp32", num_layers=3, kv_heads=1,
                     head_dim=40, page_size=16, scale_layout="none", body_nbytes=2 * fmt.body_nbytes)
    miss = decode(blob, gqa.expect(h, b"\0" * 16, tokens[:16]), key)
    assert isinstance(miss, Miss) and miss.reason is MissReason.FORMAT_MISMATCH


async def test_corrupted_latent_pages_are_detected_and_recomputed_and_a_second_node_hits(dsv3_served, valkey):
    from edgeinfer.backend.metrics import BackendMetrics
    from edgeinfer.backend.page_store.bridge import PageStoreBridge
    from edgeinfer.cache_store.index import RedisPageIndex
    from edgeinfer.cache_store.resilience import RedisGuard, redis_client
    from edgeinfer.cache_store.store import RedisPageStore, TieredPageStore
    from tests.backend.page_store.test_bridge import REGIONS, _generate, corrupt

    _, path = dsv3_served
    if valkey.proc is None:
        valkey.start()
    client = redis_client(valkey.url, socket_timeout_s=5)

    async def node(name: str, kv_dtype: str):
        engine = load_engine(path, EngineConfig(num_pages=64, cache_seed=b"mla-store-test", kv_dtype=kv_dtype))
        engine.start()
        guard = RedisGuard(timeout_s=5)
        store = RedisPageStore(client, guard=guard, timeout_s=5)
        metrics = BackendMetrics(engine.model_name)
        bridge = PageStoreBridge(engine, node_id=name, store=TieredPageStore([("redis", store)]),
                                 page_key=PageKey.from_secret(b"mla-page-key-for-the-store-test"), index=RedisPageIndex(client, guard=guard),
                                 metrics=metrics, redis_client=client, fetch_timeout_s=30,
                                 fetch_chunk_bytes=4 * engine.runner.page_bytes)
        await bridge.start()
        return engine, bridge, store, metrics

    prompt = torch.randint(100, 49000, (150,), generator=torch.Generator().manual_seed(9)).tolist()   # 9 full pages
    for kv_dtype in ("auto", "fp8_e4m3", "int8"):
        a, a_bridge, store, _ = await node(f"a-{kv_dtype}", kv_dtype)
        b, b_bridge, _, b_metrics = await node(f"b-{kv_dtype}", kv_dtype)
        try:
            ns = f"mla-{kv_dtype}"
            ref, usage = await _generate(a, a_bridge, prompt, ns)
            assert usage.cached_tokens == 0 and await a_bridge.flush(30)
            hashes = page_hashes(a.key_context(ns), prompt[: (len(prompt) - 1) // 16 * 16])
            blobs = await store.get_many(hashes)
            assert all(blobs) and len(hashes) == 9
            out, usage = await _generate(b, b_bridge, prompt, ns)     # node B: the latent pages from the store
            assert usage.cached_tokens == 9 * 16 and out == ref
            # every stored latent page corrupted: a fresh node detects each, recomputes, answers the same
            c, c_bridge, _, c_metrics = await node(f"c-{kv_dtype}", kv_dtype)
            try:
                rng = random.Random(3)
                bad = [corrupt(blob, rng, rng.choice(REGIONS)) for blob in blobs]
                for h, blob in zip(hashes, bad):
                    await client.set(store.keys.page(h), blob, keepttl=True)
                out, usage = await _generate(c, c_bridge, prompt, ns)
                failures = c_metrics.registry.get_sample_value("edgeinfer_backend_integrity_failures_total",
                                                               {"model": c.model_name, "source": "redis"}) or 0
                assert out == ref and usage.cached_tokens == 0 and failures >= 1
                assert await c_bridge.flush(30)                     # the bad page was dropped; C republished its own
                assert (await store.get_many(hashes[:1]))[0] not in (None, bad[0])
            finally:
                await c_bridge.stop()
                c.stop()
        finally:
            for e, br in ((a, a_bridge), (b, b_bridge)):
                await br.stop()
                e.stop()


def test_int4_experts_of_deepseek_v3_keep_mla_dense_and_match_the_dequantized_model(tmp_path):
    from edgeinfer.backend.model.moe import Int4Experts
    from edgeinfer.backend.quant.quantize import quantize_checkpoint

    moe_checkpoints.build("deepseek_v3", tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "w4", "w4a16-g32", "rtn", progress=False)
    plain = load_model(tmp_path / "w4", prepack=False)
    assert isinstance(plain.layers[1].mlp.experts, Int4Experts)
    assert type(plain.layers[1].self_attn.kv_a_proj).__name__ == "DenseLinear"
    # the written checkpoint reloads to the same attention (rope rows stored in rotate-half order, said so)
    src = load_model(tmp_path / "src", prepack=False)
    for a, b in zip(src.layers, plain.layers):
        assert torch.equal(a.self_attn.w_uk, b.self_attn.w_uk) and torch.equal(a.self_attn.w_uv, b.self_attn.w_uv)
        assert torch.equal(a.self_attn.kv_a_proj.weight, b.self_attn.kv_a_proj.weight)
    want, want_out = greedy(plain, PROMPT, 8, num_pages=8)
    packed = load_model(tmp_path / "w4")
    got, got_out = greedy(packed, PROMPT, 8, num_pages=8)
    # prepacked: the experts run kernels.cpu (int8x2 activations: 2e-4 of the logits' norm alone); the zero-point
    # dense linears (layer 0's MLP, the shared experts) run torch's int4 GEMM in bf16 (QUANTIZATION.md), 7 % here
    assert float((got - want).norm() / want.norm()) < 0.1
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_expanded_decode_baseline_gives_the_absorbed_numbers(dsv3):
    """bench_mla's baseline (re-expanding every latent each step) computes what the absorbed decode does."""
    _, path = dsv3
    model = load_model(path)
    want, want_out = greedy(model, PROMPT, 8, num_pages=8)
    for layer in model.layers:
        layer.self_attn.decode_form = "expanded"
    got, got_out = greedy(model, PROMPT, 8, num_pages=8)
    assert torch.equal(got, want) and got_out == want_out


def test_a_latent_width_the_cpu_op_refuses_on_int8_pages_decodes_on_torch(tmp_path):
    """kv_lora_rank 24 (8 mod 16) over int8 latent pages: the C++ op takes such a value width only on 16-wide
    blocks, so the CPU path must hand this decode to the torch reference (not raise), and it decodes what the torch
    path alone decodes."""
    from tests.support.dense import decode_batch

    moe_checkpoints.build("deepseek_v3", tmp_path, kv_lora_rank=24)
    model = load_model(tmp_path)
    assert model.step_ops is not None                      # the CPU ops path
    kv, pos, meta = decode_batch(model, 2, 40)
    g = torch.Generator().manual_seed(0)
    int8 = [type(x)(torch.randint(-100, 100, x.k.shape, generator=g, dtype=torch.int8), None,
                    (torch.rand(x.k.shape[:3], generator=g) * 0.02).to(torch.bfloat16), None) for x in kv]
    ids = torch.tensor([5, 9])
    got = model.compute_logits(model(ids, pos, int8, meta))
    ops, model.step_ops = model.step_ops, None             # the torch path end to end
    want = model.compute_logits(model(ids, pos, [type(x)(x.k.clone(), None, x.k_scale.clone(), None)
                                                 for x in int8], meta))
    model.step_ops = ops
    assert (got - want).abs().max().item() <= 1e-3 * want.abs().max().item()
