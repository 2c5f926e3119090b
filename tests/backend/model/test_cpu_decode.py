"""DecodePlan (backend/model/cpu_decode.py): the served native model's decode-only steps through one lean loop of the
same ops in the same order as _forward_cpu, so the same bits; used exactly where it applies."""

from __future__ import annotations

import random

import pytest
import torch

from edgeinfer import kernels
from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.model.cpu_decode import DecodePlan
from tests.support.engine_steps import generate_together


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


@pytest.fixture(scope="module")
def native_model():
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model

    model = load_model(ensure_native_default_model())
    if model.step_ops is None or not kernels.cpu.attn.enabled():
        pytest.skip("the CPU step ops are off here (not CPU, or EDGEINFER_CPU_KERNELS=torch)")
    return model


@pytest.fixture
def plan_runs(monkeypatch):
    calls = {"n": 0}
    run = DecodePlan.run

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(DecodePlan, "run", counted)
    return calls


def _generate(model, lean: bool, kv: str, prompts: list[list[int]], tokens: int):
    model.lean_decode = lean
    try:
        eng = LLMEngine(model, None, EngineConfig(kv_dtype=kv, num_pages=64))
        return generate_together(eng, prompts, "p", [tokens] * len(prompts))
    finally:
        model.lean_decode = True


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_lean_decode_gives_the_module_paths_tokens_and_logprobs_bit_for_bit(native_model, plan_runs, batch, kv):
    """Also on fp8 and int8 pools: the rope op quantizes the new rows as it stores them, so the plan applies."""
    torch.set_grad_enabled(False)
    prompts = [prompt(10 + i, 20 + 17 * i) for i in range(batch)]
    slow = _generate(native_model, False, kv, prompts, 6)
    assert plan_runs["n"] == 0
    fast = _generate(native_model, True, kv, prompts, 6)
    assert plan_runs["n"] == 5                 # every decode step (the first token comes from the prefill)
    for (t0, lp0, _), (t1, lp1, _) in zip(slow, fast, strict=True):
        assert t0 == t1 and len(t0) == 6
        assert torch.equal(torch.tensor(lp0), torch.tensor(lp1))   # same bits, not just close


def test_mixed_steps_take_the_module_path(native_model, plan_runs):
    torch.set_grad_enabled(False)
    # a step that prefills one prompt while another decodes is mixed: module path for it, plan for the rest
    eng = LLMEngine(native_model, None, EngineConfig(kv_dtype="auto", num_pages=64, max_num_batched_tokens=16))
    generate_together(eng, [prompt(4, 8), prompt(5, 40)], "m", [6, 2])
    assert 0 < plan_runs["n"] < eng.steps


def test_no_plan_for_a_model_without_x8_linears(smol_model):
    assert DecodePlan.build(smol_model) is None


def capture_first_step(monkeypatch) -> tuple[list, object]:
    """DecodePlan.run spied on: ([the first decode step's (plan, x, positions, kv_caches, meta, ops, the pool's
    k, v, k_scale, v_scale per layer as they were)], the unspied run)."""
    seen: list = []
    run = DecodePlan.run

    def spy(self, x, positions, kv_caches, meta, ops):
        if not seen:
            seen.append((self, x.clone(), positions, kv_caches, meta, ops,
                         [tuple(None if t is None else t.clone() for t in (c.k, c.v, c.k_scale, c.v_scale))
                          for c in kv_caches]))
        return run(self, x, positions, kv_caches, meta, ops)
    monkeypatch.setattr(DecodePlan, "run", spy)
    return seen, run


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "int8"])
def test_the_cpp_layer_loop_is_the_python_loop_bit_for_bit_and_its_reference(native_model, monkeypatch, kv):
    """kernels/cpu/attn.cpp decode_layers runs DecodePlan's loop in one call: the same bits as the loop in Python
    (run_python), close to its pure-torch reference (attn_reference.decode_layers), and a GEMM swapped for its
    reference (as tests do) sends the plan back to the Python loop."""
    from edgeinfer.backend.model import cpu_decode as llama
    from edgeinfer.kernels.cpu import attn_reference
    from edgeinfer.kernels.cpu import reference as gemm_ref

    torch.set_grad_enabled(False)
    seen, run = capture_first_step(monkeypatch)
    _generate(native_model, True, kv, [prompt(21, 30), prompt(22, 45)], 3)
    plan, x, positions, kv_caches, meta, ops, snap = seen[0]
    scales0 = [(None if c.k_scale is None else c.k_scale.clone(), None if c.v_scale is None else c.v_scale.clone())
               for c in kv_caches]

    def restore():
        for c, (k, v, _, _), (ks, vs) in zip(kv_caches, snap, scales0):
            c.k.copy_(k)
            c.v.copy_(v)
            if ks is not None:
                c.k_scale.copy_(ks)
                c.v_scale.copy_(vs)

    outs = []
    for fn in (run, DecodePlan.run_python):
        restore()
        xs = x.clone()
        outs.append((fn(plan, xs, positions, kv_caches, meta, ops), xs, kv_caches[-1].k.clone()))
    (h1, x1, k1), (h2, x2, k2) = outs
    assert torch.equal(h1, h2) and torch.equal(x1, x2) and torch.equal(k1, k2)

    restore()
    xr = x.clone()
    kvl, scales, ints = plan._kv_lists(kv_caches)
    hr = attn_reference.decode_layers(xr, attn_reference.rms_norm(xr, *plan.first_norm), positions,
                                      plan.model.rotary.cos, plan.model.rotary.sin, meta.slot_mapping,
                                      meta.decode_block_tables, meta.decode_context_lens, plan.weights, kvl, scales,
                                      plan.extras, ints, plan.floats, plan.residual, plan.tau)
    assert float((hr - h1).abs().max()) <= 2e-3 * float(h1.abs().max()), float((hr - h1).abs().max())

    python_loop = []
    run_python = DecodePlan.run_python
    monkeypatch.setattr(DecodePlan, "run_python", lambda self, *a: python_loop.append(1) or run_python(self, *a))
    monkeypatch.setattr(llama.cpu_kernels, "q4_1x8_gemm_residual", gemm_ref.q4_1x8_gemm_residual)
    restore()
    run(plan, x.clone(), positions, kv_caches, meta, ops)
    assert python_loop == [1]


# ---------------------------------------------------------------- Mixture-of-Experts layers (issue 56)

@pytest.fixture(scope="module")
def glm_native(smol_dir, tmp_path_factory):
    """A tiny GLM-4.5 (QK-norm, partial rotary, qkv bias, a dense first layer, sigmoid routing with a correction
    bias, a shared expert) through a Q4_0 GGUF, imported natively: its experts prepacked for q4_1x8_moe."""
    from edgeinfer.backend.model.gguf_import import default_gguf_path, import_gguf
    from edgeinfer.backend.model.loader import load_model
    from tests.support import moe_checkpoints

    d = tmp_path_factory.mktemp("glm-plan")
    hf = moe_checkpoints.servable("glm4_moe", d / "hf", smol_dir)
    src = moe_checkpoints.write_moe_gguf(hf, d / "q4_0.gguf", default_gguf_path(), quant="Q4_0")
    model = load_model(import_gguf(src, d / "native", native=True, progress=False))
    if model.step_ops is None or not kernels.cpu.attn.enabled():
        pytest.skip("the CPU step ops are off here (not CPU, or EDGEINFER_CPU_KERNELS=torch)")
    return model


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_moe_layers_run_in_the_plan_with_the_module_paths_bits(glm_native, plan_runs, monkeypatch, scoring):
    """The decode plan covers GLM-4.5's layers: attention with QK-norm, partial rotary and a qkv bias, the dense
    first MLP, and MoE layers (the router's top-k, the routed experts in one q4_1x8_moe call, the shared expert).
    The C++ loop, its Python twin (run_python) and the module path give the same tokens and logprob bits, with
    GLM's sigmoid routing and with Qwen3-MoE's softmax top-k (the same model routed that way)."""
    import dataclasses

    from edgeinfer.backend.model import cpu_decode
    from edgeinfer.backend.model.moe import SparseMoE

    torch.set_grad_enabled(False)
    model = glm_native
    moe_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moe_layers and not isinstance(model.layers[0].mlp, SparseMoE)
    if scoring == "softmax":
        for m in moe_layers:
            monkeypatch.setattr(m, "moe", dataclasses.replace(m.moe, scoring="softmax", norm_topk_prob=True))
    monkeypatch.setattr(model, "_decode_plan", DecodePlan.build(model))
    assert model._decode_plan is not None and all(r.moe is not None for r in model._decode_plan.layers[1:])
    prompts = [prompt(30 + i, 11 + 9 * i) for i in range(3)]
    slow = _generate(model, False, "int8", prompts, 5)
    assert plan_runs["n"] == 0
    fast = _generate(model, True, "int8", prompts, 5)
    assert plan_runs["n"] == 4
    monkeypatch.setattr(cpu_decode, "_CPP_LOOP", False)
    python_loop = _generate(model, True, "int8", prompts, 5)
    assert plan_runs["n"] == 8
    for (t0, lp0, _), (t1, lp1, _), (t2, lp2, _) in zip(slow, fast, python_loop, strict=True):
        assert t0 == t1 == t2 and len(t0) == 5
        assert torch.equal(torch.tensor(lp0), torch.tensor(lp1)) and torch.equal(torch.tensor(lp0), torch.tensor(lp2))


def test_the_moe_layer_loop_is_close_to_its_pure_torch_reference(glm_native, monkeypatch):
    """decode_layers on MoE layers against attn_reference.decode_layers (the references' ops and GEMMs, the same
    routing): one captured decode step of the GLM model, from the same pool and residual stream."""
    from edgeinfer.kernels.cpu import attn_reference

    torch.set_grad_enabled(False)
    seen, run = capture_first_step(monkeypatch)
    monkeypatch.setattr(glm_native, "_decode_plan", DecodePlan.build(glm_native))
    _generate(glm_native, True, "int8", [prompt(41, 25), prompt(42, 12)], 2)
    plan, x, positions, kv_caches, meta, ops, snap = seen[0]
    outs = []
    for fn in (lambda xs: run(plan, xs, positions, kv_caches, meta, ops), lambda xs: attn_reference.decode_layers(
            xs, attn_reference.rms_norm(xs, *plan.first_norm), positions, plan.model.rotary.cos,
            plan.model.rotary.sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
            plan.weights, *plan._kv_lists(kv_caches)[:2], plan.extras, plan._kv_lists(kv_caches)[2], plan.floats,
            plan.residual, plan.tau)):
        for c, (k, v, ks, vs) in zip(kv_caches, snap):
            c.k.copy_(k)
            c.v.copy_(v)
            c.k_scale.copy_(ks)
            c.v_scale.copy_(vs)
        outs.append(fn(x.clone()))
    got, want = outs
    assert float((got - want).abs().max()) <= 2e-3 * float(want.abs().max()), float((got - want).abs().max())


def test_the_plan_refuses_experts_split_over_ranks(glm_native, monkeypatch):
    from edgeinfer.backend.model.moe import SparseMoE

    layer = next(layer for layer in glm_native.layers if isinstance(layer.mlp, SparseMoE))
    monkeypatch.setattr(layer.mlp, "expert_range", (0, 8))
    assert DecodePlan.build(glm_native) is None
