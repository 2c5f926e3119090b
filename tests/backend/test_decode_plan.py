"""DecodePlan (backend/model/llama.py): the served native model's decode-only steps through one lean loop of the
same ops in the same order as _forward_cpu, so the same bits; used exactly where it applies."""

from __future__ import annotations

import random

import pytest
import torch

from edgeinfer import kernels
from edgeinfer.backend.engine.config import EngineConfig
from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.model.llama import DecodePlan
from tests.backend.engine_steps import generate_together


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


@pytest.fixture(scope="module")
def native_model():
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.llama import load_model

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


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_lean_decode_gives_the_module_paths_tokens_and_logprobs_bit_for_bit(native_model, plan_runs, batch, kv):
    """Also on an fp8 pool: the rope op quantizes the new rows as it stores them, so the plan applies."""
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
