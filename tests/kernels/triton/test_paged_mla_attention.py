"""paged_mla_decode_attention: the Triton kernel (one program per sequence and block of heads over latent rows)
against its torch reference; the reference against the expanded, per-head attention it stands for; the latent
store (fp8 / int8 scales per row) against a direct quantization."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_device

from edgeinfer.kernels.kv_store import FP8, INT8, quantize_rows
from edgeinfer.kernels.paged_mla_attention import (
    gather_latents,
    mla_latent_store,
    paged_mla_decode_attention_reference,
    paged_mla_decode_attention_triton,
)

PAGE = 16
# (heads, kv_lora_rank, rope, context lens): heads off the 16-row block, contexts off the tile and the page
CASES = [(4, 32, 8, [5, 33]), (20, 64, 16, [1, 70, 17]), (16, 32, 8, [48])]
# scores and outputs in the q dtype's precision (tl.dot in bf16/fp16), fp32 exact up to summation order
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def pool(lens: list[int], d: int, dtype: torch.dtype, seed: int = 0):
    """A paged latent pool with each sequence's rows on shuffled pages -> (cache, scale, tables, lens, rows)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // PAGE) for n in lens)
    num_pages = len(lens) * width + 1
    perm = torch.randperm(num_pages, generator=g)
    tables = perm[: len(lens) * width].view(len(lens), width).to(torch.int32)
    cache = torch.zeros(num_pages, PAGE, 1, d, dtype=dtype)
    scale = torch.ones(num_pages, PAGE, 1, dtype=torch.bfloat16) if dtype in (FP8, INT8) else None
    rows = []
    for b, n in enumerate(lens):
        lat = torch.randn(n, d, generator=g)
        slots = torch.tensor([int(tables[b, i // PAGE]) * PAGE + i % PAGE for i in range(n)])
        mla_latent_store(lat, cache, slots, scale)
        rows.append(lat)
    return cache, scale, tables, torch.tensor(lens, dtype=torch.int32), rows


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 0.0), (FP8, 0.07), (INT8, 0.005)], ids=str)
def test_latent_store_and_gather_round_trip(dtype, bound):
    cache, scale, tables, lens, rows = pool([21, 40], 40, dtype)
    for b, lat in enumerate(rows):
        got = gather_latents(cache, scale, tables[b], len(lat))
        if scale is not None:   # exactly what per-row quantization gives
            q, s = quantize_rows(lat[:, None, :], dtype, torch.bfloat16)
            want = (q.float() * s.float()[..., None])[:, 0]
            assert torch.equal(got, want)
            assert 0 < float((got - lat).abs().max() / lat.abs().max()) < bound   # int8: half a step of amax/127
        else:
            assert torch.equal(got, lat)


def test_reference_equals_expanded_per_head_attention():
    """Absorbed MLA decode = attention with K_h = W_UK_h c (+ k_pe), V_h = W_UV_h c, per head."""
    h, r, rope, nope, vd, n = 4, 32, 8, 16, 12, 29
    g = torch.Generator().manual_seed(1)
    cache, _, tables, lens, rows = pool([n], r + rope, torch.float32)
    w_uk, w_uv = torch.randn(h, nope, r, generator=g), torch.randn(h, vd, r, generator=g)
    q_nope, q_pe = torch.randn(1, h, nope, generator=g), torch.randn(1, h, rope, generator=g)
    q = torch.cat((torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_pe), -1)
    lat_out = paged_mla_decode_attention_reference(q, cache, tables, lens, 0.3, r)
    got = torch.einsum("bhr,hvr->bhv", lat_out, w_uv)
    c, k_pe = rows[0][:, :r], rows[0][:, r:]
    k = torch.cat((torch.einsum("hnr,tr->htn", w_uk, c), k_pe[None].expand(h, -1, -1)), -1)   # [h, n, nope+rope]
    v = torch.einsum("hvr,tr->htv", w_uv, c)
    p = torch.softmax(torch.einsum("hd,htd->ht", torch.cat((q_nope[0], q_pe[0]), -1), k) * 0.3, -1)
    want = torch.einsum("ht,htv->hv", p, v)
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("quant", [None, FP8, INT8], ids=["cache-qdtype", "cache-fp8", "cache-int8"])
def test_kernel_matches_reference(case, q_dtype, quant):
    h, r, rope, lens = case
    cache, scale, tables, ctx, _ = pool(lens, r + rope, quant or q_dtype, seed=2)
    q = torch.randn(len(lens), h, r + rope, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    want = paged_mla_decode_attention_reference(q, cache, tables, ctx, 0.125, r, scale)
    got = on_device(paged_mla_decode_attention_triton)(q, cache, tables, ctx, 0.125, r, scale)
    assert got.shape == (len(lens), h, r) and got.dtype == q_dtype
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err <= TOL[q_dtype], f"{err:.2e}"


def test_tolerance_catches_an_off_by_one_context():
    h, r, rope, lens = CASES[1]
    cache, scale, tables, ctx, _ = pool(lens, r + rope, torch.float16, seed=2)
    q = torch.randn(len(lens), h, r + rope, generator=torch.Generator().manual_seed(3)).half()
    want = paged_mla_decode_attention_reference(q, cache, tables, ctx, 0.125, r, scale)
    short = paged_mla_decode_attention_reference(q, cache, tables, ctx - 1, 0.125, r, scale)
    short[:, :, :] = torch.where(ctx[:, None, None] > 1, short, want)     # a one-token context has no shorter form
    assert float((short.float() - want.float()).abs().max() / want.float().abs().max()) > TOL[torch.float16]


def test_bad_shapes_name_what_was_expected():
    cache, scale, tables, ctx, _ = pool([5], 40, FP8)
    q = torch.randn(1, 4, 40)
    with pytest.raises(ValueError, match="an fp8/int8 cache needs a contiguous scale"):
        paged_mla_decode_attention_reference(q, cache, tables, ctx, 0.1, 32, None)
    with pytest.raises(ValueError, match=r"cache \(.*\) must be \[pages, page_size, 1, 48\]"):
        paged_mla_decode_attention_reference(torch.randn(1, 4, 48), cache, tables, ctx, 0.1, 32, scale)
    with pytest.raises(ValueError, match="v_dim 40 must be in"):
        paged_mla_decode_attention_reference(q, cache, tables, ctx, 0.1, 40, scale)
