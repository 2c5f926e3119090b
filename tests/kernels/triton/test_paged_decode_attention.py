"""paged_decode_attention: reference vs dense attention, Triton kernel vs reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import FP8, build_paged_kv, naive_attention, on_device

from edgeinfer import kernels
from edgeinfer.kernels.paged_decode_attention import (
    paged_decode_attention_reference,
    paged_decode_attention_triton,
    pick_num_splits,
)

# empty, single token, inside one page, crossing several pages (page_size 5 below)
CONTEXT_LENS = [0, 1, 4, 17, 33]
GQA = [(4, 4), (8, 2), (8, 1)]  # (heads, kv_heads): ratios 1, 4, 8
HEAD_DIM = 40  # not a power of two: masked lanes in the head dimension
DTYPES = [  # (q dtype, cache dtype)
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, FP8),
    (torch.bfloat16, torch.int8),
]
# The kernel rounds probabilities (times the fp8 v scale) to the q dtype before the P @ V dot,
# the reference stays in fp32: errors are a few ulps of the 16-bit type; fp32 uses ieee dots.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(heads, kv_heads, dtype, cache_dtype, lens=CONTEXT_LENS, page_size=5):
    kv = build_paged_kv(lens, kv_heads, HEAD_DIM, page_size, dtype, cache_dtype)
    q = torch.randn(len(lens), heads, HEAD_DIM, dtype=dtype)
    return q, kv


def run(fn, q, kv, **kw):
    return on_device(fn)(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 1 / math.sqrt(HEAD_DIM),
              kv.k_scale, kv.v_scale, **kw)


@pytest.mark.parametrize("heads,kv_heads", GQA, ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8, torch.int8], ids=str)
def test_reference_matches_dense_attention(heads, kv_heads, cache_dtype):
    q, kv = make_case(heads, kv_heads, torch.float32, cache_dtype)
    out = run(paged_decode_attention_reference, q, kv)
    for b, n in enumerate(CONTEXT_LENS):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))  # empty context -> zeros
            continue
        dense = naive_attention(q[b : b + 1], kv.dense_k[b], kv.dense_v[b], 1 / math.sqrt(HEAD_DIM))[0]
        torch.testing.assert_close(out[b], dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", GQA, ids=str)
@pytest.mark.parametrize("dtype,cache_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split-k"])
def test_kernel_matches_reference(heads, kv_heads, dtype, cache_dtype, num_splits):
    q, kv = make_case(heads, kv_heads, dtype, cache_dtype)
    ref = run(paged_decode_attention_reference, q, kv)
    out = run(paged_decode_attention_triton, q, kv, num_splits=num_splits, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_default_splits_and_dispatch_with_out(monkeypatch):
    q, kv = make_case(8, 2, torch.float16, FP8, lens=[70, 3], page_size=16)
    ref = run(paged_decode_attention_reference, q, kv)
    out = torch.full_like(q, float("nan"))
    monkeypatch.setenv("EDGEINFER_KERNELS", "triton")
    result = run(kernels.paged_decode_attention, q, kv, out=out)
    assert torch.equal(result, out)  # written into out and returned
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_split_heuristic():
    cpu = torch.device("cpu")
    assert pick_num_splits(32, 8, 8192, 64, cpu) == 1  # enough programs already
    assert pick_num_splits(1, 1, 8192, 64, cpu) == 8  # 2 * 4 "SMs" on the interpreter
    assert pick_num_splits(1, 1, 100, 64, cpu) == 1  # short context: no split


def _args():
    q, kv = make_case(8, 2, torch.bfloat16, FP8, lens=[9, 3])
    return dict(q=q, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
                context_lens=kv.context_lens, sm_scale=0.1, k_scale=kv.k_scale, v_scale=kv.v_scale)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(q=a["q"].half().to(torch.int16)), "q dtype"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables dtype"),
    (lambda a: a.update(context_lens=a["context_lens"].long()), "context_lens dtype"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2)), "k_cache must be contiguous"),
    (lambda a: a.update(q=a["q"][:, :5]), "q heads = 5 must be a multiple of kv_heads = 2"),
    (lambda a: a.update(q=a["q"][..., :32]), "q head_dim = 32 != k_cache head_dim = 40"),
    (lambda a: a.update(context_lens=a["context_lens"][:1]), "context_lens has 1 sequences"),
    (lambda a: a.update(k_scale=None), "k_scale is required"),
    (lambda a: a.update(v_scale=a["v_scale"][:-1].contiguous()), "v_scale shape"),
    (lambda a: a.update(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()), "k_cache dtype"),
    (lambda a: a.update(out=torch.empty(2, 8, 40)), "out dtype"),
])
def test_bad_launch_raises_before_launch(change, message):
    args = _args()
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention_triton(**args)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2)], ids=str)
def test_kernel_matches_reference_with_bf16_scales(heads, kv_heads):
    # the engine stores fp8 scales in bf16 (2 bytes per token-head); kernel and reference upcast them alike
    q, kv = make_case(heads, kv_heads, torch.bfloat16, FP8)
    kv = kv._replace(k_scale=kv.k_scale.to(torch.bfloat16), v_scale=kv.v_scale.to(torch.bfloat16))
    ref = run(paged_decode_attention_reference, q, kv)
    out = run(paged_decode_attention_triton, q, kv, num_splits=3, block_n=16)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[torch.bfloat16],
                               rtol=TOLERANCE[torch.bfloat16])
    kv = kv._replace(k_scale=kv.k_scale.float(), v_scale=kv.v_scale.float())
    torch.testing.assert_close(ref.float(), run(paged_decode_attention_reference, q, kv).float(), atol=0, rtol=0)
