"""Prepacked (oneDNN) dense linears: same math as the plain layout, clear errors, honest byte counts;
and the engine-thread helpers the CPU speed depends on (in_fresh_thread, engine restart)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.loading import in_fresh_thread
from edgeinfer.backend.model.linear import DenseLinear, can_prepack, cpu_prepack_enabled
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("shape", [(960, 576), (41, 9), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_fp32_matches_plain_linear(rows, shape, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(shape, generator=g)
    b = torch.randn(shape[0], generator=g) if bias else None
    x = torch.randn(rows, shape[1], generator=g)
    lin = DenseLinear(w.clone(), None if b is None else b.clone())
    assert lin.prepack()
    assert lin.weight is None and lin.packed is not None
    # fp32 with a different accumulation order: K=1536 sums of N(0,1) products reach |y| ~ 100
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), atol=2e-4 * shape[1] ** 0.5, rtol=1e-5)
    # leading dims are kept: [2, rows, in] -> [2, rows, out]
    x3 = torch.stack([x, x])
    assert lin(x3).shape == (2, rows, shape[0])


@needs_mkldnn
def test_prepacked_bf16_matches_plain_linear_where_supported():
    w = torch.randn(256, 128).bfloat16()
    lin = DenseLinear(w.clone())
    if not can_prepack(w):
        assert not lin.prepack() and lin.weight is not None   # nothing changed where oneDNN can't take bf16
        pytest.skip("this CPU has no bf16 support in oneDNN")
    assert lin.prepack()
    x = torch.randn(16, 128).bfloat16()
    # bf16 output rounding: 8 bits of mantissa on |y| ~ 11
    torch.testing.assert_close(lin(x).float(), torch.nn.functional.linear(x, w).float(), atol=0.1, rtol=0.02)


def test_prepack_refuses_what_onednn_cannot_take():
    lin = DenseLinear(torch.randn(8, 4).half())
    assert not lin.prepack()
    assert lin.packed is None and lin.weight is not None
    x = torch.randn(3, 4).half()
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight))


def test_bad_prepack_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("EDGEINFER_CPU_PREPACK", "yes")
    with pytest.raises(ValueError, match="EDGEINFER_CPU_PREPACK='yes'; expected 0 or 1"):
        cpu_prepack_enabled()
    monkeypatch.setenv("EDGEINFER_CPU_PREPACK", "0")
    assert not cpu_prepack_enabled()


@needs_mkldnn
def test_weight_bytes_unchanged_by_prepacking(smol_dir):
    from edgeinfer.backend.model.loader import load_model

    plain = load_model(smol_dir, prepack=False)
    packed = load_model(smol_dir, prepack=True)
    assert packed.weight_bytes() == plain.weight_bytes()
    assert packed.linear_weight_bytes() == plain.linear_weight_bytes()
    # SmolLM2 ties lm_head to the embedding: the packed lm_head is a second copy, reported as such
    assert packed.prepacked_copy_bytes() == plain.cfg.vocab_size * plain.cfg.hidden_size * 4
    assert plain.prepacked_copy_bytes() == 0
    assert all(m.packed is not None for m in packed.modules() if isinstance(m, DenseLinear))
    assert packed.embed_tokens is packed.lm_head    # the embedding lookup keeps the plain table


@needs_mkldnn
def test_untied_lm_head_is_held_once_when_prepacked(smol_dir):
    """An untied head has one holder (lm_head_linear): packing it frees the plain copy, nothing is counted
    twice, and the logits match the plain layout."""
    import dataclasses

    from edgeinfer.backend.model.loader import build_model, read_tensors
    from edgeinfer.backend.model.model_config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.from_dir(smol_dir), tie_word_embeddings=False)
    tensors = read_tensors(smol_dir)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].flip(0).contiguous()
    plain = build_model(cfg, tensors, torch.float32, torch.device("cpu"))
    packed = build_model(cfg, tensors, torch.float32, torch.device("cpu"), prepack=True)
    assert packed.lm_head is None and packed.lm_head_linear.prepacked and plain.lm_head is not None
    assert packed.prepacked_copy_bytes() == 0
    assert packed.weight_bytes() == plain.weight_bytes() == sum(t.numel() * 4 for t in tensors.values())
    h = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed.compute_logits(h), plain.compute_logits(h), atol=1e-3, rtol=1e-4)


def test_in_fresh_thread_returns_and_raises():
    import threading

    main = threading.get_ident()
    assert in_fresh_thread(lambda a, b=0: (a + b, threading.get_ident() != main), 2, b=3) == (5, True)

    def boom():
        raise KeyError("from the thread")

    with pytest.raises(KeyError, match="from the thread"):
        in_fresh_thread(boom)


async def test_engine_serves_again_after_stop_and_start(smol_model, smol_tokenizer):
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=64))
    prompt = list(range(100, 140))

    async def once(rid: str) -> list[int]:
        req = GenerateRequest(rid, prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "ns")
        return [t for c in [c async for c in eng.generate(req)] for t in c.token_ids]

    eng.start()
    try:
        first = await asyncio.wait_for(once("a"), 60)
    finally:
        eng.stop()
    eng.start()
    try:
        second = await asyncio.wait_for(once("b"), 60)
    finally:
        eng.stop()
    assert len(first) == 6 and second == first


@needs_mkldnn
def test_metrics_report_the_prepacked_copy(smol_model, smol_tokenizer):
    from edgeinfer.backend.metrics import BackendMetrics

    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=8), model_name="smol")
    m = BackendMetrics("smol")
    m.set_memory(eng)
    got = m.registry.get_sample_value("edgeinfer_backend_prepacked_copy_bytes", {"model": "smol"})
    assert got == smol_model.prepacked_copy_bytes() > 0
    assert m.registry.get_sample_value("edgeinfer_backend_weight_bytes", {"model": "smol"}) == smol_model.weight_bytes()
