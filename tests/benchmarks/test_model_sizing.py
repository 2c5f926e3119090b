"""benchmarks/sizing.py's parameter formulas against transformers' own parameter count, on small configs of
the same classes (DeepSeek-V3 = Kimi K2's architecture, GLM-4.5/4.6), and its KV arithmetic on the real configs."""

from __future__ import annotations

import pytest
import torch

from benchmarks import sizing as ms
from tests.support import moe_checkpoints


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3"])
def test_parameter_formula_equals_transformers_count(kind):
    from transformers import AutoModelForCausalLM

    cfg = moe_checkpoints.config(kind, num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    theirs = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    raw = cfg.to_dict()
    raw["head_dim"] = cfg.head_dim if kind == "glm4_moe" else None
    ours = ms.parameters(raw)
    assert sum(ours.values()) == theirs, (ours, theirs)


def test_kimi_k2_latent_kv_is_576_values_a_layer_and_fp8_halves_it():
    kv16, kv8 = ms.kv_bytes_per_token(ms.KIMI_K2, "bf16"), ms.kv_bytes_per_token(ms.KIMI_K2, "fp8")
    assert kv16["values"] == 576 * 61
    assert kv16["bytes"] == 2 * 576 * 61 and kv8["bytes"] == (576 + 4) * 61
    assert ms.expanded_kv_bytes_per_token(ms.KIMI_K2) / kv16["bytes"] > 30      # what the latent saves


def test_sizes_land_where_the_published_totals_are():
    s = ms.sizing()
    kimi, glm = s["models"]["Kimi K2"], s["models"]["GLM-4.6"]
    assert 1020 < kimi["total_parameters_b"] < 1050 and 31 < kimi["active_parameters_b"] < 34
    assert 350 < glm["total_parameters_b"] < 360 and 31 < glm["active_parameters_b"] < 34
    assert 560 < kimi["weights_gb"]["int4"] < 610                   # Kimi-K2-Thinking ships ~594 GB
    # fp8 KV fits about twice the sequences of bf16 KV
    for m in (kimi, glm):
        a, b = m["max_sequences"]["weights int4, kv fp8, 32k"], m["max_sequences"]["weights int4, kv bf16, 32k"]
        assert 1.8 < a / b <= 2.0
