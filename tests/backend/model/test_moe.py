"""Mixture-of-Experts (Qwen3-MoE, GLM-4.5): routing against transformers' own routers, the model against
transformers' forward on tiny random checkpoints (fp32, and INT4 experts against their dequantized weights), the
grouped CPU expert GEMM against its reference, and config errors that name the field."""

from __future__ import annotations

import json

import pytest
import torch

import edgeinfer.kernels.cpu as kc
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.model.model_config import CheckpointError, ModelConfig
from edgeinfer.backend.model.moe import ExpertOrder, Int4Experts, route
from edgeinfer.backend.model.packing import group_dequantize_mins
from edgeinfer.backend.quant.quantize import QuantizeError, quantize_checkpoint
from edgeinfer.kernels.cpu import reference as ref
from tests.support import moe_checkpoints
from tests.support.dense import greedy

PROMPT = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def hf_run(hf, ids: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
        out = hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[0, len(ids):]
    return logits, out.tolist()


# ---------------------------------------------------------------- routing

ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


def _raw(kind: str, **kw) -> dict:
    return moe_checkpoints.config(kind, **kw).to_dict() | {"architectures": [ARCH[kind]]}


def _moe_cfg(kind: str, **kw) -> ModelConfig:
    return ModelConfig.from_dict(_raw(kind, **kw))


def test_sigmoid_group_routing_equals_transformers_router_and_bias_moves_only_the_choice():
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    hf_cfg = moe_checkpoints.config("glm4_moe", n_routed_experts=32, n_group=4, topk_group=2, num_experts_per_tok=6)
    router = Glm4MoeTopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.5)
    x = torch.randn(50, hf_cfg.hidden_size, generator=g)
    _, hf_w, hf_ids = router(x)
    moe = _moe_cfg("glm4_moe", n_routed_experts=32, n_group=4, topk_group=2, num_experts_per_tok=6).moe
    assert moe is not None and moe.scoring == "sigmoid" and moe.routed_scaling_factor == 2.5
    w, ids = route(x @ router.weight.t(), moe, router.e_score_correction_bias)

    def by_expert(w, ids):   # top-k comes back unsorted: compare {expert: weight} per token
        return [dict(zip(i.tolist(), ww.tolist())) for ww, i in zip(w, ids)]
    ours, theirs = by_expert(w, ids), by_expert(hf_w, hf_ids)
    assert [sorted(a) for a in ours] == [sorted(b) for b in theirs]
    for a, b in zip(ours, theirs):
        assert all(abs(a[e] - b[e]) <= 1e-6 for e in a)
    # the bias changed the choice for some tokens (else this test could not tell) ...
    _, unbiased_ids = route(x @ router.weight.t(), moe, None)
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, unbiased_ids))
    # ... and the weights are the unbiased sigmoid scores: weights taken from the biased scores differ
    scores = (x @ router.weight.t()).sigmoid()
    biased = (scores + router.e_score_correction_bias).gather(1, ids)
    biased = biased / biased.sum(-1, keepdim=True) * moe.routed_scaling_factor
    assert (biased - w).abs().max() > 1e-2


def test_softmax_routing_equals_transformers_with_and_without_renormalization():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for norm in (True, False):
        hf_cfg = moe_checkpoints.config("qwen3_moe", norm_topk_prob=norm)
        router = Qwen3MoeTopKRouter(hf_cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)))
        x = torch.randn(20, hf_cfg.hidden_size, generator=torch.Generator().manual_seed(2))
        _, hf_w, hf_ids = router(x)
        moe = _moe_cfg("qwen3_moe", norm_topk_prob=norm).moe
        w, ids = route(x @ router.weight.t(), moe)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(w, hf_w.float(), rtol=1e-6, atol=1e-6)
        assert bool(torch.allclose(w.sum(-1), torch.ones(20))) == norm


def test_expert_order_groups_pairs_by_expert_and_combines_back():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order = ExpertOrder.of(ids, 4)
    assert order.counts == [2, 1, 3, 0] and order.offsets.tolist() == [0, 2, 3, 6, 6]
    assert ids.reshape(-1)[order.pairs].tolist() == [0, 0, 1, 2, 2, 2]
    rows = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 2)    # row i in expert order
    got = order.combine(rows, torch.ones(3, 2), 3)
    want = torch.zeros(3, 2)
    for i, p in enumerate(order.pairs.tolist()):
        want[p // 2] += i
    assert torch.equal(got, want)


# ---------------------------------------------------------------- the model against transformers

@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe"])
def test_tiny_moe_matches_transformers_prefill_and_32_greedy_tokens(tmp_path, kind):
    hf = moe_checkpoints.build(kind, tmp_path)
    ours = load_model(tmp_path)
    cfg = ours.cfg
    assert cfg.moe is not None and cfg.qk_norm
    if kind == "glm4_moe":
        assert cfg.rope_dim == cfg.head_dim // 2 and cfg.attention_bias and cfg.moe.n_shared_experts == 1
        assert cfg.moe.sparse_layers == (False, True, True)
    else:
        assert cfg.moe.sparse_layers == (True, False, True)   # mlp_only_layers=[1]
    logits, out = greedy(ours, PROMPT, 32, num_pages=8)
    ref_logits, theirs = hf_run(hf, PROMPT, 32)
    assert (ref_logits - logits).abs().max().item() <= 1e-4
    assert out == theirs


def test_correction_bias_applied_to_the_weights_breaks_parity(tmp_path, monkeypatch):
    """The parity above fails when the bias leaks into the weights: the check can fail."""
    import edgeinfer.backend.model.moe as moe_mod

    hf = moe_checkpoints.build("glm4_moe", tmp_path)
    real = moe_mod.route

    def leaky(logits, moe, bias=None):
        w, ids = real(logits, moe, bias)
        if bias is None:
            return w, ids
        s = logits.float().sigmoid() + bias
        w = s.gather(1, ids)
        return w / w.sum(-1, keepdim=True) * moe.routed_scaling_factor, ids
    monkeypatch.setattr(moe_mod, "route", leaky)
    logits, _ = greedy(load_model(tmp_path), PROMPT, 1, num_pages=8)
    ref_logits, _ = hf_run(hf, PROMPT, 1)
    assert (ref_logits - logits).abs().max().item() > 1e-2


# ---------------------------------------------------------------- INT4 experts

@pytest.fixture(scope="module")
def glm_int4(tmp_path_factory):
    src = tmp_path_factory.mktemp("glm")
    hf = moe_checkpoints.build("glm4_moe", src)
    dst = tmp_path_factory.mktemp("glm_q") / "w4"
    quantize_checkpoint(src, dst, "w4a16-g32", "rtn", progress=False)
    return hf, dst


def deq(linear) -> torch.Tensor:
    """An unprepacked W4A16Linear's weight as its INT4 values give it (fp32 [out, in])."""
    from edgeinfer.kernels.w4a16_gemm import group_dequantize_tensor

    return group_dequantize_tensor(linear.qweight, linear.scales, linear.zeros, linear.group_size)


def _hf_with_weights_of(hf, model):
    """transformers' model with our INT4 model's dequantized expert weights in place of its own."""
    import copy

    hf = copy.deepcopy(hf)
    for i, layer in enumerate(model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if not isinstance(experts, Int4Experts):
            continue
        gate_up, down = experts.dequantized()
        with torch.no_grad():
            hf.model.layers[i].mlp.experts.gate_up_proj.copy_(gate_up)
            hf.model.layers[i].mlp.experts.down_proj.copy_(down)
        for name, mod in (("shared_experts", layer.mlp.shared_experts),):
            hmod = getattr(hf.model.layers[i].mlp, name)
            gu = deq(mod.gate_up_proj)
            with torch.no_grad():
                inter = gu.shape[0] // 2
                hmod.gate_proj.weight.copy_(gu[:inter])
                hmod.up_proj.weight.copy_(gu[inter:])
                hmod.down_proj.weight.copy_(deq(mod.down_proj))
    for i, layer in enumerate(model.layers):
        attn, hattn = layer.self_attn, hf.model.layers[i].self_attn
        qkv = deq(attn.qkv_proj)
        c = model.cfg
        with torch.no_grad():
            hattn.q_proj.weight.copy_(qkv[:c.q_size])
            hattn.k_proj.weight.copy_(qkv[c.q_size:c.q_size + c.kv_size])
            hattn.v_proj.weight.copy_(qkv[c.q_size + c.kv_size:])
            hattn.o_proj.weight.copy_(deq(attn.o_proj))
        if not hasattr(layer.mlp, "experts"):
            gu = deq(layer.mlp.gate_up_proj)
            inter = gu.shape[0] // 2
            hm = hf.model.layers[i].mlp
            with torch.no_grad():
                hm.gate_proj.weight.copy_(gu[:inter])
                hm.up_proj.weight.copy_(gu[inter:])
                hm.down_proj.weight.copy_(deq(layer.mlp.down_proj))
    return hf


def test_int4_experts_match_transformers_on_their_dequantized_weights(glm_int4):
    hf, dst = glm_int4
    plain = load_model(dst, prepack=False)                 # INT4 kept, the reference kernels (fp32 math)
    experts = plain.layers[1].mlp.experts
    assert isinstance(experts, Int4Experts) and not experts.prepacked
    oracle = _hf_with_weights_of(hf, plain)
    logits, out = greedy(plain, PROMPT, 32, num_pages=8)
    ref_logits, theirs = hf_run(oracle, PROMPT, 32)
    assert (ref_logits - logits).abs().max().item() <= 1e-4
    assert out == theirs
    # and INT4 is not the fp32 model: the quantization moved the logits
    fp32_logits, _ = hf_run(hf, PROMPT, 1)
    assert (fp32_logits - logits).abs().max().item() > 1e-3


def test_int4_experts_prepacked_run_the_grouped_cpu_kernel_near_the_exact_weights(glm_int4):
    _, dst = glm_int4
    plain, packed = load_model(dst, prepack=False), load_model(dst)
    experts = packed.layers[1].mlp.experts
    assert isinstance(experts, Int4Experts) and experts.prepacked and experts.gu_q is None
    assert packed.weight_bytes() > 0
    calls = []
    real = kc.q4_1x8_moe

    def counting(*a):
        calls.append(a[0].shape[0])
        return real(*a)
    kc.q4_1x8_moe = counting
    try:
        logits, out = greedy(packed, PROMPT, 8, num_pages=8)
    finally:
        kc.q4_1x8_moe = real
    sparse = sum(packed.cfg.moe.sparse_layers)
    assert len(calls) == sparse * 8                       # one call per MoE layer per step, never one per expert
    assert calls[0] == len(PROMPT)
    want, want_out = greedy(plain, PROMPT, 8, num_pages=8)
    rel = float((logits - want).norm() / want.norm())
    assert rel < 0.03, f"int8 activations moved the logits by {rel:.3%}"
    agree = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
    assert agree >= 0.9


def q4_slab(e: int, n: int, k: int, g: torch.Generator, scale: float, spread: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """e random Q4_1 experts [n, k] (scales up to `scale`, mins down to -`spread`) -> (their x8 slab [E, ...] for
    kernels.cpu, their dequantized weights [E, n, k])."""
    packs, dense = [], []
    for _ in range(e):
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        s = (torch.rand(n, k // 32, generator=g) * scale + 0.001).half()
        m = (-torch.rand(n, k // 32, generator=g) * spread).half()
        packs.append(kc.pack_q4_1x8(kc.pack_q4_1(q, s, m, 32)))
        dense.append(group_dequantize_mins(q, s, m, 32))
    return torch.stack(packs).contiguous(), torch.stack(dense)


@pytest.mark.parametrize("residual", [False, True], ids=["int8", "int8x2"])
def test_grouped_q4_gemm_equals_its_reference_and_per_expert_gemms(residual):
    e, n, k = 5, 40, 96
    g = torch.Generator().manual_seed(0)
    packed, dense = q4_slab(e, n, k, g, 0.05, 0.4)
    counts = [3, 0, 9, 1, 0]                               # experts without rows, one with a single row
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int64)
    x = torch.randn(sum(counts), k, generator=g)
    got = kc.q4_1x8_moe_gemm(x, packed, n, offsets, residual)
    want = ref.q4_1x8_moe_gemm(x, packed, n, offsets, residual)
    assert got.shape == (sum(counts), n)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    single = kc.q4_1x8_gemm_residual if residual else kc.q4_1x8_gemm
    for j in range(e):
        r0, r1 = int(offsets[j]), int(offsets[j + 1])
        if r1 > r0:
            assert float((got[r0:r1] - single(x[r0:r1].contiguous(), packed[j], n)).abs().max()) <= 1e-5 * float(
                want.abs().max())
            exact = x[r0:r1] @ dense[j].t()
            assert float((got[r0:r1] - exact).norm() / exact.norm()) < 0.05
    with pytest.raises(RuntimeError, match="offsets must run from 0 to M"):
        kc.q4_1x8_moe_gemm(x, packed, n, offsets - 1, residual)


@pytest.mark.parametrize("residual", [False, True], ids=["int8", "int8x2"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_fused_cpu_moe_equals_its_reference_and_the_dequantized_experts(residual, tokens):
    e, h, inter, k = 6, 64, 96, 3
    g = torch.Generator().manual_seed(tokens)
    (w_gu, gu), (w_dn, dn) = q4_slab(e, 2 * inter, h, g, 0.02, 0.1), q4_slab(e, h, inter, g, 0.02, 0.1)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    x = torch.randn(tokens, h, generator=g)
    got = kc.q4_1x8_moe(x, ids, weights, w_gu, w_dn, inter, residual)
    want = ref.q4_1x8_moe(x, ids, weights, w_gu, w_dn, inter, residual)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-4 * scale
    if residual:   # the second pass on the largest blocks only: the reference's numbers too
        part = kc.q4_1x8_moe(x, ids, weights, w_gu, w_dn, inter, residual, 0.5)
        assert float((part - ref.q4_1x8_moe(x, ids, weights, w_gu, w_dn, inter, residual, 0.5)).abs().max()) <= \
            1e-4 * scale
    exact = torch.zeros(tokens, h)
    for t in range(tokens):
        for j in range(k):
            hh = gu[int(ids[t, j])] @ x[t]
            exact[t] += weights[t, j] * (dn[int(ids[t, j])] @ (torch.nn.functional.silu(hh[:inter]) * hh[inter:]))
    assert float((got - exact).norm() / exact.norm()) < (0.01 if residual else 0.05)
    with pytest.raises(RuntimeError, match=r"ids\[0, 0\] = 6 is outside \[-1, 6\)"):
        kc.q4_1x8_moe(x, torch.full_like(ids, 6), weights, w_gu, w_dn, inter, residual)
    # expert parallelism: pairs whose expert lives on another rank come as id -1 and are skipped (weight unused);
    # the two halves of the experts, each computed with the other half's ids at -1, sum to the whole
    lo = torch.where(ids < 3, ids, -1)
    hi = torch.where(ids >= 3, ids - 3, -1)
    half = kc.q4_1x8_moe(x, lo, weights, w_gu[:3].contiguous(), w_dn[:3].contiguous(), inter, residual) + \
        kc.q4_1x8_moe(x, hi, weights, w_gu[3:].contiguous(), w_dn[3:].contiguous(), inter, residual)
    assert float((half - got).abs().max()) <= 1e-4 * scale
    ref_half = ref.q4_1x8_moe(x, lo, weights, w_gu[:3].contiguous(), w_dn[:3].contiguous(), inter, residual)
    assert float((ref_half - kc.q4_1x8_moe(x, lo, weights, w_gu[:3].contiguous(), w_dn[:3].contiguous(), inter,
                                           residual)).abs().max()) <= 1e-4 * scale


# ---------------------------------------------------------------- config and quantizer errors

def test_moe_config_errors_name_the_field():
    raw = _raw("glm4_moe")
    with pytest.raises(CheckpointError, match="n_group=3"):
        ModelConfig.from_dict(raw | {"n_group": 3})
    with pytest.raises(CheckpointError, match="num_experts_per_tok=20 > num_experts=16"):
        ModelConfig.from_dict(raw | {"num_experts_per_tok": 20})
    with pytest.raises(CheckpointError, match="fewer than num_experts_per_tok"):
        ModelConfig.from_dict(raw | {"num_experts_per_tok": 9, "topk_group": 1})
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        ModelConfig.from_dict(raw | {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                         "partial_rotary_factor": 0.1}})


def test_quantizer_refuses_calibrated_methods_for_moe(tmp_path):
    moe_checkpoints.build("qwen3_moe", tmp_path / "src")
    with pytest.raises(QuantizeError, match="--method rtn"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "dst", "w4a16-g32", "awq", progress=False)
    assert not (tmp_path / "dst").exists()
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]


def test_compressed_tensors_pack_quantized_experts_load_int4_and_match_the_library_dequantization(tmp_path):
    """Kimi-K2-Thinking's format: routed experts W4A16 (compressed-tensors pack-quantized, symmetric, group 32),
    everything else dense. The experts load as Int4Experts without re-rounding: the model equals transformers'
    with the weights the compressed-tensors library itself dequantizes."""
    hf = moe_checkpoints.build("glm4_moe", tmp_path / "src")
    oracle = moe_checkpoints.compressed_tensors_experts(tmp_path / "src", tmp_path / "ct")
    ours = load_model(tmp_path / "ct", prepack=False)
    experts = ours.layers[1].mlp.experts
    assert isinstance(experts, Int4Experts) and experts.gu_z is None and experts.gu_m is None   # symmetric
    assert type(ours.layers[1].self_attn.qkv_proj).__name__ == "DenseLinear"                    # ignored: dense
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            if not hasattr(layer.mlp, "experts"):
                continue
            e = hf.config.n_routed_experts
            p = f"model.layers.{i}.mlp.experts."
            gate = torch.stack([oracle[f"{p}{j}.gate_proj.weight"] for j in range(e)])
            up = torch.stack([oracle[f"{p}{j}.up_proj.weight"] for j in range(e)])
            layer.mlp.experts.gate_up_proj.copy_(torch.cat((gate, up), 1))
            layer.mlp.experts.down_proj.copy_(torch.stack([oracle[f"{p}{j}.down_proj.weight"] for j in range(e)]))
    gate_up, _ = experts.dequantized()
    assert torch.equal(gate_up, hf.model.layers[1].mlp.experts.gate_up_proj.detach())
    logits, out = greedy(ours, PROMPT, 32, num_pages=8)
    ref_logits, theirs = hf_run(hf, PROMPT, 32)
    assert (ref_logits - logits).abs().max().item() <= 1e-4 and out == theirs
    packed = load_model(tmp_path / "ct")
    assert packed.layers[1].mlp.experts.prepacked
    fast, _ = greedy(packed, PROMPT, 2, num_pages=8)
    assert float((fast - logits).norm() / logits.norm()) < 0.03


def test_compressed_tensors_config_errors_name_the_field():
    from edgeinfer.backend.model.quant_format import QuantConfig

    good = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                "group_size": 32}}}}
    assert QuantConfig.from_dict(good, "c").group_size == 32
    with pytest.raises(CheckpointError, match="format='float-quantized' is unsupported"):
        QuantConfig.from_dict(good | {"format": "float-quantized"}, "c")
    asym = json.loads(json.dumps(good))
    asym["config_groups"]["g"]["weights"]["symmetric"] = False
    with pytest.raises(CheckpointError, match="symmetric"):
        QuantConfig.from_dict(asym, "c")
    w8a8 = json.loads(json.dumps(good))
    w8a8["config_groups"]["g"]["input_activations"] = {"num_bits": 8}
    with pytest.raises(CheckpointError, match="weight-only"):
        QuantConfig.from_dict(w8a8, "c")
