"""paged_decode_attention: one query token per sequence against its paged K/V (GQA, FP8/INT8 pages).

The kernel runs one program per (sequence, kv head, context split): the GQA group of query
heads shares every K/V tile it loads; each tile is folded in by kernels/_online_softmax.py
(shared with the prefill kernel). FP8 and INT8 pages are multiplied by their per-token scales
after the dot products (scores * k_scale, probabilities * v_scale), so dequantization
costs one vector multiply per tile. Long contexts are split over programs (split-K) and
merged by a second pass from each split's running max, sum and unnormalized output.
"""

from __future__ import annotations

import torch

from edgeinfer.kernels._memo import LastCall
from edgeinfer.kernels._online_softmax import online_softmax_tile
from edgeinfer.kernels._triton import (
    cdiv,
    check,
    check_fp8_scale,
    check_tensor,
    jit,
    next_pow2,
    num_sms,
    require_triton,
    tl,
    upcast_dot,
)
from edgeinfer.kernels.kv_store import CACHE_DTYPES, _raw, quantized

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the extra parallelism


def _select(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    return _raw(cache).index_select(0, pages).view(cache.dtype)


def page_index(block_tables, context_lens, num_tokens: int, page_size: int) -> torch.Tensor:
    """-> [B * ceil(num_tokens / page_size)] int64 page ids, padding entries (past a context) set to page 0."""
    num_pages = cdiv(num_tokens, page_size)
    used = torch.arange(num_pages, device=block_tables.device)[None, :] < (context_lens[:, None] + page_size - 1) // page_size
    return torch.where(used, block_tables[:, :num_pages].long(), 0).flatten()   # padding may be garbage


def gather_index(cache, scale, flat, batch: int, num_tokens: int, dtype=torch.float32):
    """Pages `flat` (from page_index) -> [B, num_tokens, kv_heads, head_dim] in `dtype` (fp8 dequantized).

    Rows past a sequence's context hold whatever the pool holds there (finite: the pool is zero-initialised
    and only ever written with finite values); callers mask them.
    """
    # index_select, not cache[pages]: advanced indexing is ~300x slower on CPU for this shape
    x = _select(cache, flat).view(batch, -1, *cache.shape[2:])[:, :num_tokens]
    if scale is not None:
        sc = scale.index_select(0, flat).view(batch, -1, scale.shape[2])[:, :num_tokens]
        x = x.float() * sc.float()[..., None]
    return x.to(dtype)


def decode_plan(block_tables, context_lens, page_size: int, dtype: torch.dtype):
    """-> (longest context N, page_index over it (K and V share it), [B, 1, 1, N] additive mask in `dtype`:
    0 inside each context, -inf past it (what SDPA would make of a bool mask on every call))."""
    num_tokens = int(context_lens.max()) if context_lens.numel() else 0
    if num_tokens == 0:
        return 0, None, None
    flat = page_index(block_tables, context_lens, num_tokens, page_size)
    valid = torch.arange(num_tokens, device=context_lens.device)[None, :] < context_lens[:, None]
    mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))
    return num_tokens, flat, mask[:, None, None, :]


_LAST_PLAN = LastCall()   # the layers of one forward share the plan


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    # fp32 everywhere on CPU (bf16/fp16 matmuls there are slow and less exact); half types stay on GPU
    return torch.float32 if q.device.type == "cpu" else q.dtype


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, sm_scale,
                                     k_scale=None, v_scale=None, out=None):
    # q: [B, heads, head_dim] -> out [B, heads, head_dim]; an empty context gives zeros
    batch, heads, head_dim = q.shape
    cd = _compute_dtype(q)
    num_tokens, flat, mask = _LAST_PLAN.get((block_tables, context_lens), (batch, k_cache.shape[1], cd),
                                            lambda: decode_plan(block_tables, context_lens, k_cache.shape[1], cd))
    if num_tokens == 0:
        y = torch.zeros_like(q)
        return y if out is None else out.copy_(y)
    k = gather_index(k_cache, k_scale, flat, batch, num_tokens, cd)
    v = gather_index(v_cache, v_scale, flat, batch, num_tokens, cd)
    # k, v: [B, N, kv_heads, D] -> [B, kv_heads, N, D]; q: [B, heads, 1, D]; GQA inside SDPA
    y = torch.nn.functional.scaled_dot_product_attention(
        q.to(cd)[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        scale=sm_scale, enable_gqa=True)
    y = torch.nan_to_num(y[:, :, 0, :], nan=0.0).to(q.dtype)   # all-masked rows (empty context) -> 0
    return y if out is None else out.copy_(y)


@jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, lens_ptr,
                         out_ptr, m_ptr, l_ptr, acc_ptr,
                         qk_scale, split_size, page_size, head_dim,
                         stride_qb, stride_qh, stride_qd,
                         stride_cp, stride_co, stride_ch, stride_cd,
                         stride_sp, stride_so, stride_sh,
                         stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, QUANT: tl.constexpr,
                         UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    ctx = tl.load(lens_ptr + b).to(tl.int64)
    start = split * split_size
    end = tl.minimum(start + split_size, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    mask_g = g < GROUP
    mask_d = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        mask_t = t < end
        m_i, l_i, acc = online_softmax_tile(q, m_i, l_i, acc, t, mask_t, mask_t[None, :], d, mask_d, b, kvh,
                                            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr,
                                            qk_scale, page_size, stride_cp, stride_co, stride_ch, stride_cd,
                                            stride_sp, stride_so, stride_sh, stride_tb, QUANT, PRECISION)
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    else:
        # partials: m, l [B, heads, NUM_SPLITS]; acc [B, heads, NUM_SPLITS, head_dim]
        part = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(m_ptr + part, m_i, mask=mask_g)
        tl.store(l_ptr + part, l_i, mask=mask_g)
        tl.store(acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])


@jit
def _decode_reduce_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, head_dim, stride_ob, stride_oh,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mask_s = s < NUM_SPLITS
    mask_d = d < head_dim
    part = (b * tl.num_programs(1) + h) * NUM_SPLITS + s
    m = tl.load(m_ptr + part, mask=mask_s, other=-1.0e30)
    lsum = tl.load(l_ptr + part, mask=mask_s, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * head_dim + d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(lsum * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=mask_d)


def check_paged_kv(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale) -> None:
    check_tensor("q", q, dtypes=ACT_DTYPES, ndim=3)
    dev = q.device
    check_tensor("k_cache", k_cache, dtypes=CACHE_DTYPES, ndim=4, contiguous=True, device=dev)
    check_tensor("v_cache", v_cache, dtypes=CACHE_DTYPES, ndim=4, contiguous=True, device=dev)
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=dev)
    check(block_tables.stride(1) == 1, lambda: f"block_tables must be contiguous along pages, got strides {block_tables.stride()}")
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), ndim=1, contiguous=True, device=dev)
    check(v_cache.shape == k_cache.shape, lambda: f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    check(v_cache.dtype == k_cache.dtype, lambda: f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    check(heads % kv_heads == 0, lambda: f"q heads = {heads} must be a multiple of kv_heads = {kv_heads}")
    check(k_cache.shape[3] == head_dim, lambda: f"q head_dim = {head_dim} != k_cache head_dim = {k_cache.shape[3]}")
    check(context_lens.shape[0] == block_tables.shape[0],
          lambda: f"context_lens has {context_lens.shape[0]} sequences, block_tables has {block_tables.shape[0]}")
    if quantized(k_cache.dtype):
        check_fp8_scale("k_scale", k_scale, k_cache)
        check_fp8_scale("v_scale", v_scale, k_cache)
    else:
        check(k_cache.dtype == q.dtype,
              lambda: f"k_cache dtype {k_cache.dtype} != q dtype {q.dtype} (only fp8/int8 caches convert)")
        check(k_scale is None and v_scale is None,
              lambda: f"k_scale/v_scale are only for fp8/int8 caches, cache is {k_cache.dtype}")


def check_block(name: str, n: int) -> None:
    check(n >= 16 and n & (n - 1) == 0, lambda: f"{name} must be a power of two >= 16, got {n}")


def output_like(q, out, op: str) -> torch.Tensor:
    """A caller's `out` checked against q, or a new one; raises first if Triton cannot run `op`."""
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), ndim=3, device=q.device)
        check(out.shape == q.shape, lambda: f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
        check(out.stride(2) == 1, lambda: f"out must be contiguous along head_dim, got strides {out.stride()}")
    require_triton(op)
    return torch.empty_like(q) if out is None else out


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 stays exact; tf32 is ignored for 16-bit


def pick_num_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    wanted = cdiv(2 * num_sms(device), max(1, batch * kv_heads))
    return max(1, min(wanted, cdiv(max_tokens, MIN_SPLIT_TOKENS), cdiv(max_tokens, block_n)))


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, sm_scale,
                                  k_scale=None, v_scale=None, out=None, *, num_splits=None, block_n=64):
    check_paged_kv(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    batch, heads, head_dim = q.shape
    check(q.shape[0] == block_tables.shape[0], lambda: f"q has {batch} sequences, block_tables has {block_tables.shape[0]}")
    check_block("block_n", block_n)
    out = output_like(q, out, "paged_decode_attention")
    if batch == 0:
        return out
    kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    max_tokens = block_tables.shape[1] * page_size  # an upper bound known without a device sync
    if num_splits is None:
        num_splits = pick_num_splits(batch, kv_heads, max_tokens, block_n, q.device)
    check(num_splits >= 1, lambda: f"num_splits must be >= 1, got {num_splits}")
    split_size = cdiv(cdiv(max(max_tokens, 1), num_splits), block_n) * block_n
    quant = quantized(k_cache.dtype)
    if num_splits > 1:
        m = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        acc = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    else:
        m = lsum = acc = out
    group = heads // kv_heads
    block_d = max(16, next_pow2(head_dim))
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, block_tables, context_lens,
        out, m, lsum, acc,
        sm_scale * LOG2E, split_size, page_size, head_dim,
        *q.stride(), *k_cache.stride(), *(k_scale.stride() if quant else (0, 0, 0)),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, NUM_SPLITS=num_splits, QUANT=quant,
        UPCAST_DOT=upcast_dot(q.dtype), PRECISION=dot_precision(q.dtype),
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, heads)](
            out, m, lsum, acc, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
        )
    return out

