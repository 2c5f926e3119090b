"""The tile step both paged attention kernels share: load one BLOCK_N tile of keys and values through the
block table, score it, and fold it into the running (max, sum, output) of a flash-attention online softmax.

Scores are in log2 units (qk_scale includes log2(e)). FP8 pages are multiplied by their per-token scales after
the dot products (scores * k_scale, probabilities * v_scale). `visible` [rows, BLOCK_N] (or [1, BLOCK_N]) masks
the keys a query row may see; `mask_t` [BLOCK_N] the keys that exist.
"""

from __future__ import annotations

from edgeinfer.kernels._triton import jit, tl


@jit
def online_softmax_tile(q, m_i, l_i, acc, t, mask_t, visible, d, mask_d, b, kvh,
                        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr,
                        qk_scale, page_size,
                        stride_cp, stride_co, stride_ch, stride_cd,
                        stride_sp, stride_so, stride_sh, stride_tb,
                        QUANT: tl.constexpr, PRECISION: tl.constexpr):
    page = tl.load(tables_ptr + b * stride_tb + t // page_size, mask=mask_t, other=0).to(tl.int64)
    off = t % page_size
    row = page * stride_cp + off * stride_co + kvh * stride_ch
    # k, v: [BLOCK_N, BLOCK_D]
    kv_mask = mask_t[:, None] & mask_d[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if QUANT:
        srow = page * stride_sp + off * stride_so + kvh * stride_sh
        s = s * tl.load(k_scale_ptr + srow, mask=mask_t, other=0.0).to(tl.float32)[None, :]
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if QUANT:
        p = p * tl.load(v_scale_ptr + srow, mask=mask_t, other=0.0).to(tl.float32)[None, :]
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
