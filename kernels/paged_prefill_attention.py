"""paged_prefill_attention: causal attention of a chunk of new tokens against their paged K/V.

The new tokens' K/V are already in the cache (kv_store runs first), so one loop over the
sequence's pages covers the cached prefix and the chunk itself; the causal mask compares
absolute positions (query row i of sequence b sits at context_lens[b] - q_len_b + i).
One program per (query block, sequence, query head), flash-attention style online softmax
(the tile step in kernels/_online_softmax.py, shared with the decode kernel).
"""

from __future__ import annotations

import torch

from edgeinfer.kernels._online_softmax import online_softmax_tile
from edgeinfer.kernels._triton import cdiv, check, check_tensor, jit, next_pow2, tl, upcast_dot
from edgeinfer.kernels.kv_store import quantized
from edgeinfer.kernels.paged_decode_attention import (
    LOG2E,
    _compute_dtype,
    check_block,
    check_paged_kv,
    dot_precision,
    gather_index,
    output_like,
    page_index,
)


def paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sm_scale,
                                      k_scale=None, v_scale=None, out=None):
    # q: [T, heads, head_dim] packed by cu_seqlens_q -> out [T, heads, head_dim]
    out = torch.empty_like(q) if out is None else out
    cd = _compute_dtype(q)
    bounds = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, n in enumerate(lens):
        s, e = bounds[b], bounds[b + 1]
        if e == s:
            continue
        pages = page_index(block_tables[b : b + 1], context_lens[b : b + 1], n, k_cache.shape[1])   # K and V
        k = gather_index(k_cache, k_scale, pages, 1, n, cd)[0].transpose(0, 1)
        v = gather_index(v_cache, v_scale, pages, 1, n, cd)[0].transpose(0, 1)
        # k, v: [kv_heads, n, D]; q: [heads, q_len, D]; query i sits at position n - q_len + i
        qb, k, v = q[s:e].to(cd).transpose(0, 1)[None], k[None], v[None]   # 4-D: SDPA's fused CPU path
        if e - s == n:
            y = torch.nn.functional.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=sm_scale,
                                                                 enable_gqa=True)
        else:
            allowed = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - (e - s), n, device=q.device)[:, None]
            y = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=allowed, scale=sm_scale,
                                                                 enable_gqa=True)
        out[s:e] = y[0].transpose(0, 1).to(q.dtype)
    return out


@jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, cu_ptr, lens_ptr, out_ptr,
                    qk_scale, page_size, head_dim,
                    stride_qt, stride_qh, stride_qd,
                    stride_cp, stride_co, stride_ch, stride_cd,
                    stride_sp, stride_so, stride_sh,
                    stride_tb, stride_ot, stride_oh,
                    GROUP: tl.constexpr, QUANT: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    qblock = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    kvh = h // GROUP
    q_start = tl.load(cu_ptr + b).to(tl.int64)
    q_len = tl.load(cu_ptr + b + 1).to(tl.int64) - q_start
    ctx = tl.load(lens_ptr + b).to(tl.int64)
    prefix = ctx - q_len
    rows = qblock * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mask_r = rows < q_len
    mask_d = d < head_dim
    qpos = prefix + rows
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :] * stride_qd,
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    last_key = tl.minimum(ctx, prefix + (qblock + 1) * BLOCK_M)  # causal: later keys are never seen
    last_key = tl.where(qblock * BLOCK_M < q_len, last_key, 0)
    for n0 in range(0, last_key, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        mask_t = t < ctx
        visible = mask_t[None, :] & (t[None, :] <= qpos[:, None])
        m_i, l_i, acc = online_softmax_tile(q, m_i, l_i, acc, t, mask_t, visible, d, mask_d, b, kvh,
                                            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr,
                                            qk_scale, page_size, stride_cp, stride_co, stride_ch, stride_cd,
                                            stride_sp, stride_so, stride_sh, stride_tb, QUANT, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])


def paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sm_scale,
                                   k_scale=None, v_scale=None, out=None, *, max_seqlen_q=None,
                                   block_m=64, block_n=64):
    check_paged_kv(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1, contiguous=True, device=q.device)
    batch = block_tables.shape[0]
    check(cu_seqlens_q.shape[0] == batch + 1,
          lambda: f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, expected batch + 1 = {batch + 1}")
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    out = output_like(q, out, "paged_prefill_attention")
    if q.shape[0] == 0 or batch == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one device sync per prefill
    if max_seqlen_q == 0:
        return out
    tokens, heads, head_dim = q.shape
    kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    quant = quantized(k_cache.dtype)
    grid = (cdiv(max_seqlen_q, block_m), batch, heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,
        block_tables, cu_seqlens_q, context_lens, out,
        sm_scale * LOG2E, page_size, head_dim,
        *q.stride(), *k_cache.stride(), *(k_scale.stride() if quant else (0, 0, 0)),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, QUANT=quant, UPCAST_DOT=upcast_dot(q.dtype), PRECISION=dot_precision(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(head_dim)),
        num_warps=4, num_stages=2,
    )
    return out
