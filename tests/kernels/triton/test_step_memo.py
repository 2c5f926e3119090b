"""Per-step metadata work runs once per forward, not once per layer (kernels._memo.LastCall), and a
remembered result is never served for changed metadata."""

from __future__ import annotations

import importlib
import math

import torch
from kernel_cases import build_paged_kv

from edgeinfer.kernels.paged_decode_attention import paged_decode_attention_reference

# the modules (the package's attributes of these names are the dispatching functions)
decode_mod = importlib.import_module("edgeinfer.kernels.paged_decode_attention")
kv_store_mod = importlib.import_module("edgeinfer.kernels.kv_store")

HEAD_DIM = 16


def _count(monkeypatch, module, name: str) -> dict:
    calls = {"n": 0}
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_the_layers_of_a_decode_step_share_one_plan_and_one_keep_mask(smol_model, monkeypatch):
    from tests.support.dense import greedy

    # the memo serves the dispatching layer loop (CUDA, half dtypes, EDGEINFER_CPU_KERNELS=torch): run that loop
    # (on CPU fp32 the model otherwise takes kernels.cpu.attn's fused step, which has no per-layer plan)
    monkeypatch.setattr(smol_model, "step_ops", None)
    plans = _count(monkeypatch, decode_mod, "decode_plan")
    keeps = _count(monkeypatch, kv_store_mod, "_kept")
    decode_steps = 3
    greedy(smol_model, [1, 2, 3, 4, 5], decode_steps + 1)   # one prefill forward, then decode forwards
    assert smol_model.cfg.num_layers > 1
    assert plans["n"] == decode_steps
    assert keeps["n"] == decode_steps + 1


def _case():
    kv = build_paged_kv([7, 12, 3], 2, HEAD_DIM, 4, torch.float32, torch.float32, spare_pages=6)
    q = torch.randn(3, 4, HEAD_DIM)
    return q, kv


def _attend(q, kv, tables, lens):
    return paged_decode_attention_reference(q, kv.k_cache, kv.v_cache, tables, lens, 1 / math.sqrt(HEAD_DIM))


def test_in_place_changes_to_the_metadata_are_seen():
    q, kv = _case()
    tables, lens = kv.block_tables.clone(), kv.context_lens.clone()
    _attend(q, kv, tables, lens)
    tables[0, 0] = tables[0, 1]          # same tensor objects, new contents
    lens[2] = 1
    fresh = _attend(q, kv, tables.clone(), lens.clone())
    torch.testing.assert_close(_attend(q, kv, tables, lens), fresh, rtol=0, atol=0)


def test_inference_mode_tensors_are_never_remembered():
    q, kv = _case()
    with torch.inference_mode():
        tables, lens = kv.block_tables.clone(), kv.context_lens.clone()
        before = _attend(q, kv, tables, lens)
        lens[1] = 2                      # inference tensors keep no version counter
        after = _attend(q, kv, tables, lens)
        fresh = _attend(q, kv, tables.clone(), lens.clone())
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)
