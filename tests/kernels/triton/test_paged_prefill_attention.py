"""paged_prefill_attention: reference vs dense causal attention, Triton kernel vs reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import FP8, build_paged_kv, naive_attention, on_device

from edgeinfer import kernels
from edgeinfer.kernels.paged_prefill_attention import (
    paged_prefill_attention_reference,
    paged_prefill_attention_triton,
)

# (context_len, new tokens): no new tokens, a single first token, a decode-like step after a
# prefix, a chunk after a prefix crossing pages, a whole prompt, a chunk longer than one q block
SEQUENCES = [(0, 0), (1, 1), (9, 1), (17, 5), (11, 11), (40, 23)]
GQA = [(4, 4), (8, 2), (8, 1)]
HEAD_DIM = 24
DTYPES = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, FP8),
    (torch.float16, torch.int8),
]
# Same reasoning as decode: P is rounded to the q dtype before P @ V; fp32 uses ieee dots.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(heads, kv_heads, dtype, cache_dtype, sequences=SEQUENCES, page_size=4):
    kv = build_paged_kv([n for n, _ in sequences], kv_heads, HEAD_DIM, page_size, dtype, cache_dtype)
    q_lens = torch.tensor([m for _, m in sequences])
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    q = torch.randn(int(cu[-1]), heads, HEAD_DIM, dtype=dtype)
    return q, cu, kv


def run(fn, q, cu, kv, **kw):
    return on_device(fn)(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, 1 / math.sqrt(HEAD_DIM),
              kv.k_scale, kv.v_scale, **kw)


@pytest.mark.parametrize("heads,kv_heads", GQA, ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8, torch.int8], ids=str)
def test_reference_matches_dense_causal_attention(heads, kv_heads, cache_dtype):
    q, cu, kv = make_case(heads, kv_heads, torch.float32, cache_dtype)
    out = run(paged_prefill_attention_reference, q, cu, kv)
    for b, (_, m) in enumerate(SEQUENCES):
        if m == 0:
            continue
        s = int(cu[b])
        dense = naive_attention(q[s : s + m], kv.dense_k[b], kv.dense_v[b], 1 / math.sqrt(HEAD_DIM))
        torch.testing.assert_close(out[s : s + m], dense, atol=1e-5, rtol=1e-5)


def test_decode_is_prefill_with_one_token():
    sequences = [(1, 1), (9, 1), (17, 1)]
    q, cu, kv = make_case(8, 2, torch.float32, FP8, sequences)
    decode = kernels.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2,
                                            kv.k_scale, kv.v_scale)
    prefill = kernels.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, 0.2,
                                              kv.k_scale, kv.v_scale)
    torch.testing.assert_close(decode, prefill, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", GQA, ids=str)
@pytest.mark.parametrize("dtype,cache_dtype", DTYPES, ids=str)
def test_kernel_matches_reference(heads, kv_heads, dtype, cache_dtype):
    q, cu, kv = make_case(heads, kv_heads, dtype, cache_dtype)
    ref = run(paged_prefill_attention_reference, q, cu, kv)
    out = run(paged_prefill_attention_triton, q, cu, kv, block_m=16, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_dispatch_with_out_and_default_blocks(monkeypatch):
    q, cu, kv = make_case(4, 4, torch.float16, torch.float16, [(30, 30), (5, 2)])
    ref = run(paged_prefill_attention_reference, q, cu, kv)
    out = torch.full_like(q, float("nan"))
    monkeypatch.setenv("EDGEINFER_KERNELS", "triton")
    result = run(kernels.paged_prefill_attention, q, cu, kv, out=out)
    assert torch.equal(result, out)  # written into out and returned
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_no_new_tokens_is_a_no_op():
    q, cu, kv = make_case(4, 4, torch.float32, torch.float32, [(3, 0), (0, 0)])
    assert run(paged_prefill_attention_triton, q, cu, kv).shape == (0, 4, HEAD_DIM)


def _args():
    q, cu, kv = make_case(8, 2, torch.float16, FP8, [(9, 3), (4, 4)])
    return dict(q=q, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables, cu_seqlens_q=cu,
                context_lens=kv.context_lens, sm_scale=0.1, k_scale=kv.k_scale, v_scale=kv.v_scale)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q dtype"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:-1]), "cu_seqlens_q has 2 entries, expected batch"),
    (lambda a: a.update(v_cache=a["v_cache"][:-1]), "v_cache shape"),
    (lambda a: a.update(v_scale=a["v_scale"].double()), "v_scale dtype"),
    (lambda a: a.update(block_tables=a["block_tables"].t().contiguous().t()), "block_tables must be contiguous"),
    (lambda a: a.update(q=a["q"][None]), "q must have 3 dims"),
])
def test_bad_launch_raises_before_launch(change, message):
    args = _args()
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention_triton(**args)
