"""A tiny GLM-4.5 MoE through the engine, as the dense models run: continuous batching (several sequences of
different lengths in one step give transformers' greedy tokens), the prefix cache, FP8 KV pages and INT4 experts."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.loading import load_engine
from edgeinfer.backend.quant.quantize import quantize_checkpoint
from tests.support import moe_checkpoints
from tests.support.engine_steps import generate_together


@pytest.fixture(scope="module")
def glm(smol_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-glm45")
    hf = moe_checkpoints.servable("glm4_moe", out, smol_dir, max_position_embeddings=1024)
    return hf, out


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(100, 49000, (9 + 13 * i,), generator=g).tolist() for i in range(n)]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(ids):].tolist()


def test_batched_sequences_give_transformers_tokens_and_a_shared_prefix_hits_the_cache(glm):
    hf, path = glm
    eng = load_engine(path, EngineConfig(max_num_batched_tokens=64))
    ps = prompts(4)
    outs = generate_together(eng, ps, "t", [12, 12, 12, 12])
    for p, (ids, _, cached) in zip(ps, outs):
        assert ids == hf_greedy(hf, p, 12)
        assert cached == 0
    # the last prompt again (48 tokens: 3 full pages) after the first run published its pages
    again = generate_together(eng, [ps[3]], "t", [12])[0]
    assert again[0] == outs[3][0] and again[2] == 32     # 2 full pages reused (the last page is recomputed)
    other_ns = generate_together(eng, [ps[3]], "other", [12])[0]
    assert other_ns[2] == 0                               # another namespace never hits


@pytest.mark.parametrize("kv,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_quantized_kv_pages_stay_near_fp32(glm, kv, dtype):
    _, path = glm
    ps = prompts(3)
    ref = generate_together(load_engine(path, EngineConfig()), ps, "t", [16, 16, 16])
    eng = load_engine(path, EngineConfig(kv_dtype=kv))
    assert eng.kv_format == f"{kv}_hadamard" and eng.runner.kv_format.dtype == dtype
    fp8 = generate_together(eng, ps, "t", [16, 16, 16])
    agree = sum(a == b for (x, _, _), (y, _, _) in zip(ref, fp8) for a, b in zip(x, y)) / 48
    lp_diff = max(abs(a - b) for (_, x, _), (_, y, _) in zip(ref, fp8) for a, b in zip(x[:4], y[:4]))
    assert agree >= 0.75 and lp_diff < 0.5, (agree, lp_diff)


def test_int4_experts_serve_through_the_engine(glm, tmp_path):
    hf, path = glm
    dst = tmp_path / "w4"
    quantize_checkpoint(path, dst, "w4a16-g32", "rtn", progress=False)
    for f in moe_checkpoints.TOKENIZER_FILES:
        assert (dst / f).exists() or not (path / f).exists()
    eng = load_engine(dst, EngineConfig(max_num_batched_tokens=64))
    assert type(eng.model.layers[1].mlp.experts).__name__ == "Int4Experts"
    ps = prompts(3)
    outs = generate_together(eng, ps, "t", [8, 8, 8])
    solo = [generate_together(eng, [p], "solo", [8])[0][0] for p in ps]
    assert [o[0] for o in outs] == solo                  # batching does not change a sequence's tokens
