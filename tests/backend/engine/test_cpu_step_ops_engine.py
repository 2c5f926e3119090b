"""The engine's CPU decode step on kernels.cpu.attn's ops (the served fp32 CPU path), on the real SmolLM2 model:
the fused layer loop with the reference ops is the old layer loop bit for bit; with the C++ ops greedy output
equals the torch ops' token for token on the fp32 model, and on the native INT4 model (int8 activations, where
a last-bit difference can flip one activation's rounding) every chosen token is the reference's argmax or
within a near-tie of it, teacher-forced."""

from __future__ import annotations

import pytest
import torch

import edgeinfer.kernels.cpu.attn as ka
from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.kernels.cpu import attn_reference
from tests.support.engine_steps import generate_together

pytestmark = pytest.mark.slow
CHATS = ["Name three colors of the rainbow.", "What is 12 times 7?", "Write a haiku about the sea."]
TOKENS = 16


@pytest.fixture(scope="module")
def native():
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model

    model = load_model(ensure_native_default_model())
    assert model.step_ops is ka.ops()
    return model


@pytest.fixture(scope="module")
def prompts(smol_tokenizer):
    return [smol_tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]


def greedy(model, ops, prompts, kv_dtype: str):
    """3 prompts decoded together (batch 3, then fewer), greedy: [(tokens, logprobs, cached)]."""
    saved, model.step_ops = model.step_ops, ops
    try:
        eng = LLMEngine(model, None, EngineConfig(enable_prefix_cache=False, kv_dtype=kv_dtype, num_pages=256))
        return generate_together(eng, prompts, "t", [TOKENS, TOKENS - 3, TOKENS - 6])
    finally:
        model.step_ops = saved


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "int8"])
def test_fused_loop_on_the_reference_ops_is_the_old_loop_bit_for_bit(native, prompts, kv_dtype):
    fused = greedy(native, attn_reference, prompts, kv_dtype)
    old = greedy(native, None, prompts, kv_dtype)
    assert [len(t) for t, _, _ in fused] == [TOKENS, TOKENS - 3, TOKENS - 6]
    assert fused == old


def test_greedy_on_the_ops_equals_the_torch_ops_on_the_fp32_model(smol_dir, prompts):
    from edgeinfer.backend.model.loader import load_model

    model = load_model(smol_dir)
    ext, ref = greedy(model, ka._ext(), prompts, "auto"), greedy(model, attn_reference, prompts, "auto")
    assert [t for t, _, _ in ext] == [t for t, _, _ in ref]
    diff = max(abs(a - b) for (_, la, _), (_, lb, _) in zip(ext, ref) for a, b in zip(la, lb))
    assert diff < 1e-4, diff


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "int8"])
def test_native_greedy_on_the_ops_is_the_reference_argmax_or_a_near_tie(native, prompts, kv_dtype):
    from edgeinfer.backend.quant.calib import paged_prefill

    fast = greedy(native, ka._ext(), prompts, kv_dtype)
    saved, native.step_ops = native.step_ops, attn_reference
    try:   # the reference ops, teacher-forced along the C++ ops' greedy path
        margins, scale = [], 0.0
        for p, (toks, _, _) in zip(prompts, fast):
            logits = native.compute_logits(paged_prefill(native, [p + toks], kv_dtype, 16))[len(p) - 1: -1]
            chosen = logits.gather(1, torch.tensor(toks)[:, None])[:, 0]
            margins += (logits.max(-1).values - chosen).tolist()
            scale = max(scale, float(logits.abs().max()))
    finally:
        native.step_ops = saved
    assert len(margins) == 3 * TOKENS - 9
    assert max(margins) < 0.02 * scale, (max(margins), scale)
    # mostly the reference's own argmax: 35 of 39 on fp8 KV with the x8 GEMMs (the old plain kernels: >= 90%);
    # which near-ties flip depends on every roundoff upstream, so the bound is 85%, the margin bound above is the
    # accuracy claim
    assert sum(m == 0.0 for m in margins) >= 0.85 * len(margins)
