"""Multi-head Latent Attention over paged latent rows (DeepSeek-V3, Kimi K2).

The cache holds per token one row of D = kv_lora_rank + qk_rope_head_dim values (576 for Kimi K2): the normalized
latent c (kv_lora_rank) then the rotated shared rope key k_pe. Layout `[num_pages, page_size, 1, D]` (one "kv
head"), in fp32/bf16/fp16, or fp8 e4m3 / int8 with one scale per token row `[num_pages, page_size, 1]` (bf16 or fp32).

  mla_latent_store(latent [T, D], cache, slot_mapping [T] int64 (-1: skip), scale=None) -> None
  paged_mla_decode_attention(q [B, H, D], cache, block_tables [B, W] int32, context_lens [B] int32, sm_scale,
                             v_dim, scale=None) -> [B, H, v_dim]

Decode runs in the absorbed form: q is already [W_UK^T q_nope, q_pe] per head, so every head attends over the same
latent rows (MQA with a 576-wide key), and the value of a row is its first v_dim (= kv_lora_rank) values; W_UV is
applied by the caller after attention. The Triton kernel runs one program per (sequence, block of heads): each
latent tile is loaded once for BLOCK_H heads; the score is q_lat . c + q_pe . k_pe (two dots: D is not a power of
two), the online softmax in log2 units, fp8 scales applied to the scores and to the probabilities (as the GQA
kernels do). The reference gathers the sequence's rows (kernels.paged_decode_attention.gather_index) and computes
the same in fp32.
"""

from __future__ import annotations

import torch

from edgeinfer.kernels._triton import (
    cdiv,
    check,
    check_tensor,
    jit,
    next_pow2,
    require_triton,
    tl,
    upcast_dot,
)
from edgeinfer.kernels.kv_store import FP8, _kept, _raw, _rows, quantize_rows, quantized
from edgeinfer.kernels.paged_decode_attention import dot_precision, gather_index, page_index

LOG2E = 1.4426950408889634
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mla_latent_store(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                     scale: torch.Tensor | None = None) -> None:
    # latent: [T, D] -> cache rows (flat slot = page * page_size + offset); fp8/int8: per-row scale amax / qmax
    check_tensor("latent", latent, ndim=2)
    check_tensor("cache", cache, ndim=4, contiguous=True, device=latent.device)
    check(cache.shape[2] == 1 and cache.shape[3] == latent.shape[1],
          lambda: f"cache {tuple(cache.shape)} must be [pages, page_size, 1, {latent.shape[1]}]")
    check(quantized(cache.dtype) == (scale is not None),
          lambda: f"a scale goes with an fp8/int8 cache and only then (cache {cache.dtype}, scale {scale is not None})")
    keep = _kept(slot_mapping)
    slots, src = (slot_mapping, latent) if keep is None else (slot_mapping[keep], latent[keep])
    rows = src[:, None, :]                                  # [T, 1, D], the pool's row shape
    if quantized(cache.dtype):
        assert scale is not None
        q, s = quantize_rows(rows, cache.dtype, scale.dtype)   # s: [T, 1]
        _rows(cache).index_copy_(0, slots, _raw(q))
        _rows(scale).index_copy_(0, slots, s)
    else:
        _rows(cache).index_copy_(0, slots, rows.to(cache.dtype))


def gather_latents(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor, n: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first n rows of one sequence (block_table [W]) -> [n, D] in dtype (fp8 dequantized)."""
    flat = page_index(block_table[None], torch.tensor([n], device=block_table.device), n, cache.shape[1])
    return gather_index(cache, scale, flat, 1, n, dtype)[0, :, 0]


def _check(q, cache, block_tables, context_lens, v_dim, scale) -> None:
    check_tensor("q", q, dtypes=ACT_DTYPES, ndim=3)
    check_tensor("cache", cache, ndim=4, contiguous=True, device=q.device)
    b, _, d = q.shape
    check(cache.shape[2] == 1 and cache.shape[3] == d,
          lambda: f"cache {tuple(cache.shape)} must be [pages, page_size, 1, {d}] for q {tuple(q.shape)}")
    check(0 < v_dim < d, lambda: f"v_dim {v_dim} must be in (0, {d}): the latent part of each row")
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=q.device)
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), ndim=1, device=q.device)
    check(block_tables.shape[0] == b and context_lens.shape[0] == b,
          lambda: f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} must "
                  f"have one row per sequence ({b})")
    if quantized(cache.dtype):
        check(scale is not None and tuple(scale.shape) == tuple(cache.shape[:3]) and scale.is_contiguous(),
              lambda: f"an fp8/int8 cache needs a contiguous scale {tuple(cache.shape[:3])}, got "
                      f"{None if scale is None else tuple(scale.shape)}")


def paged_mla_decode_attention_reference(q, cache, block_tables, context_lens, sm_scale, v_dim, scale=None):
    # q: [B, H, D] -> [B, H, v_dim] in q.dtype
    _check(q, cache, block_tables, context_lens, v_dim, scale)
    b, h, d = q.shape
    out = torch.empty((b, h, v_dim), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    n = int(context_lens.max())
    rows = gather_index(cache, scale, page_index(block_tables, context_lens, n, cache.shape[1]), b, n)[:, :, 0]
    s = torch.einsum("bhd,bnd->bhn", q.float(), rows) * sm_scale                      # [B, H, n]
    valid = torch.arange(n, device=q.device)[None, :] < context_lens[:, None].long()
    p = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    p = p.masked_fill(~valid[:, None, :], 0.0)   # an empty context attends to nothing: zeros, not softmax's NaN
    return out.copy_(torch.einsum("bhn,bnv->bhv", p, rows[..., :v_dim]))


@jit
def _mla_decode_kernel(q_ptr, cache_ptr, scale_ptr, tables_ptr, lens_ptr, out_ptr,
                       qk_scale, page_size, heads, D, V,
                       stride_qb, stride_qh, stride_cp, stride_co, stride_sp, stride_so, stride_tb,
                       stride_ob, stride_oh,
                       QUANT: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1).to(tl.int64)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = h < heads
    dv = tl.arange(0, BLOCK_V)
    mask_v = dv < V
    dr = tl.arange(0, BLOCK_R)
    mask_r = dr < D - V
    q_row = q_ptr + b * stride_qb + h[:, None] * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)
    q_pe = tl.load(q_row + V + dr[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    if UPCAST_DOT:
        q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
    ctx = tl.load(lens_ptr + b)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_V), tl.float32)
    for start in range(0, ctx, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        mask_t = t < ctx
        page = tl.load(tables_ptr + b * stride_tb + t // page_size, mask=mask_t, other=0).to(tl.int64)
        off = t % page_size
        row = cache_ptr + page * stride_cp + off * stride_co
        c = tl.load(row[:, None] + dv[None, :], mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(q_lat.dtype)
        pe = tl.load(row[:, None] + V + dr[None, :], mask=mask_t[:, None] & mask_r[None, :], other=0.0).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), s, input_precision=PRECISION)
        if QUANT:
            sc = tl.load(scale_ptr + page * stride_sp + off * stride_so, mask=mask_t, other=0.0).to(tl.float32)
            s = s * sc[None, :]
        s = tl.where(mask_t[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * sc[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q_lat.dtype), c, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + h[:, None] * stride_oh + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_h[:, None] & mask_v[None, :])


def paged_mla_decode_attention_triton(q, cache, block_tables, context_lens, sm_scale, v_dim, scale=None,
                                      block_n: int = 32):
    _check(q, cache, block_tables, context_lens, v_dim, scale)
    require_triton("paged_mla_decode_attention")
    q = q.contiguous()
    b, h, d = q.shape
    out = torch.empty((b, h, v_dim), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    quant = quantized(cache.dtype)
    block_h = max(16, min(64, next_pow2(h)))
    cache_view = cache.view(torch.uint8).view(FP8) if cache.dtype == FP8 else cache
    _mla_decode_kernel[(b, cdiv(h, block_h))](
        q, cache_view, scale if quant else cache, block_tables, context_lens, out,
        sm_scale * LOG2E, cache.shape[1], h, d, v_dim,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
        *(scale.stride()[:2] if quant else (0, 0)), block_tables.stride(0), out.stride(0), out.stride(1),
        QUANT=quant, UPCAST_DOT=upcast_dot(q.dtype), PRECISION=dot_precision(q.dtype),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_V=max(16, next_pow2(v_dim)), BLOCK_R=max(16, next_pow2(d - v_dim)),
        num_warps=4, num_stages=2,
    )
    return out
