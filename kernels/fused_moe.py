"""fused_moe_w4a16: a Mixture-of-Experts MLP over INT4 expert weights, fp16/bf16 activations.

    out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]

Weights per expert in w4a16_gemm's layout with a leading expert dim: w1 (gate rows, then up rows) qweight
[E, 2I, H//2] uint8, scales / zeros [E, 2I, H//G]; w2 qweight [E, H, I//2], scales / zeros [E, H, I//G];
zeros None = symmetric (q - 8), fp16 or fp32 (fractional zero points) otherwise.

The Triton path (as vLLM's fused_moe): the T*k (token, slot) pairs are sorted by expert and each expert's run
padded to BLOCK_M rows, so every M tile belongs to one expert. Kernel 1 gathers its tokens' rows of x, runs the
gate and the up tile of the same output columns side by side (two accumulators over one pass of x) and stores
silu(gate) * up, in x's dtype, per pair. Kernel 2 runs the down projection over those rows and stores each pair's
row times its routing weight in fp32; the k rows of a token are summed in fp32 and cast to x's dtype. The reference
computes the same in fp32 with dequantized weights, expert by expert, with the same two roundings to x's dtype.
"""

from __future__ import annotations

import torch

from edgeinfer.kernels._triton import cdiv, check, check_tensor, jit, require_triton, tl, upcast_dot
from edgeinfer.kernels.w4a16_gemm import ACT_DTYPES, dequant_tile, group_dequantize_tensor, load_even_odd

BLOCK_M = 16


def _check(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group_size) -> None:
    check_tensor("x", x, ndim=2)
    t, h = x.shape
    check_tensor("ids", ids, dtypes=(torch.int64, torch.int32), ndim=2, device=x.device)
    check_tensor("weights", weights, ndim=2, device=x.device)
    check(ids.shape[0] == t and weights.shape == ids.shape,
          lambda: f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, k] with T = {t}")
    check_tensor("w1 qweight", w1q, dtypes=(torch.uint8,), ndim=3, contiguous=True, device=x.device)
    check_tensor("w2 qweight", w2q, dtypes=(torch.uint8,), ndim=3, contiguous=True, device=x.device)
    e, two_i, h2 = w1q.shape
    check(h2 * 2 == h and two_i % 2 == 0, lambda: f"w1 qweight {tuple(w1q.shape)} must be [E, 2I, H//2], H = {h}")
    inter = two_i // 2
    check(tuple(w2q.shape) == (e, h, inter // 2),
          lambda: f"w2 qweight {tuple(w2q.shape)} must be [E, H, I//2] = [{e}, {h}, {inter // 2}]")
    check(isinstance(group_size, int) and group_size >= 32 and group_size % 32 == 0 and h % group_size == 0
          and inter % group_size == 0,
          lambda: f"group_size {group_size} must be a multiple of 32 dividing H = {h} and I = {inter}")
    for name, s, z, n, k in (("w1", w1s, w1z, two_i, h), ("w2", w2s, w2z, h, inter)):
        check_tensor(f"{name} scales", s, dtypes=(torch.float16,), ndim=3, contiguous=True, device=x.device)
        check(tuple(s.shape) == (e, n, k // group_size),
              lambda name=name, s=s, n=n, k=k: f"{name} scales {tuple(s.shape)} must be [{e}, {n}, {k // group_size}]")
        if z is not None:
            check_tensor(f"{name} zeros", z, dtypes=(torch.float16, torch.float32), ndim=3, contiguous=True,
                         device=x.device)
            check(z.shape == s.shape,
                  lambda name=name, z=z, s=s: f"{name} zeros {tuple(z.shape)} != scales {tuple(s.shape)}")


def fused_moe_w4a16_reference(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group_size=128):
    # x: [T, H], weights / ids: [T, k] -> [T, H] in x.dtype
    _check(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group_size)
    t, h = x.shape
    k = ids.shape[1]
    inter = w1q.shape[1] // 2
    flat = ids.reshape(-1).long()
    flat = torch.where(flat >= 0, flat, w1q.shape[0])      # -1: an expert on another rank, sorted last, skipped
    pairs = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1q.shape[0] + 1).tolist()[: w1q.shape[0]]
    rows = torch.zeros(t * k, h, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        p = pairs[start:start + n]
        start += n
        w1 = group_dequantize_tensor(w1q[e], w1s[e], None if w1z is None else w1z[e], group_size)
        w2 = group_dequantize_tensor(w2q[e], w2s[e], None if w2z is None else w2z[e], group_size)
        hh = x.index_select(0, p // k).float() @ w1.t()
        act = (torch.nn.functional.silu(hh[:, :inter]) * hh[:, inter:]).to(x.dtype)
        rows[p] = (act.float() @ w2.t()) * weights.reshape(-1)[p].float()[:, None]
    return rows.view(t, k, h).sum(1).to(x.dtype)


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sorted_pairs [S] int32: the pairs in expert order, each expert's run padded to a multiple of block_m
    with T*k; block_expert [S // block_m] int32: the expert of each M tile, num_experts past the last run). S is
    the bound T*k + E*(block_m - 1) rounded up to block_m: no device-to-host copy sizes the grid."""
    flat = ids.reshape(-1).long()
    tk = flat.numel()
    flat = torch.where(flat >= 0, flat, num_experts)        # -1: an expert on another rank: never placed
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)[: int(counts.sum())]   # a host sync only where -1 ids are possible
    expert_of_sorted = flat[order]
    first = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    first[1:] = counts.cumsum(0)[:-1]
    rank = torch.arange(order.numel(), device=ids.device) - first[expert_of_sorted]
    size = cdiv(tk + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((size,), tk, dtype=torch.int32, device=ids.device)
    sorted_pairs[starts[expert_of_sorted] + rank] = order.to(torch.int32)
    tile_rows = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, tile_rows, right=True).to(torch.int32)
    return sorted_pairs, block_expert


@jit
def _expert_tile(pairs_ptr, tile_expert_ptr, qw_ptr, s_ptr, z_ptr, stride_qe, stride_se, TK,
                 BLOCK_M: tl.constexpr):
    """This program's M tile of expert-sorted pairs: (expert, pair ids, which are real, the expert's qweight,
    scales and zeros); expert >= NUM_EXPERTS marks a tile past the last expert's run. Both kernels start so."""
    pid_m = tl.program_id(0).to(tl.int64)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return e, pairs, pairs < TK, qw_ptr + e * stride_qe, s_ptr + e * stride_se, z_ptr + e * stride_se


@jit
def _gate_up_kernel(x_ptr, pairs_ptr, tile_expert_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
                    TK, H, INTER, NUM_EXPERTS, TOP_K,
                    stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                    GROUP_SIZE: tl.constexpr, SYMMETRIC: tl.constexpr, UPCAST_DOT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(1).to(tl.int64)
    e, pairs, mask_m, qw_e, s_e, z_e = _expert_tile(pairs_ptr, tile_expert_ptr, qw_ptr, s_ptr, z_ptr, stride_qe,
                                                    stride_se, TK, BLOCK_M)
    if e < NUM_EXPERTS:
        tok = pairs // TOP_K
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < INTER
        rb = tl.arange(0, BLOCK_K // 2)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kb = k0 // 2 + rb
            x_even, x_odd = load_even_odd(x_ptr, tok, kb, stride_xm, 1, mask_m)
            if UPCAST_DOT:
                x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            group = k0 // GROUP_SIZE
            for half in tl.static_range(2):   # the gate rows, then the up rows of the same output columns
                w_even, w_odd = dequant_tile(qw_e, s_e, z_e, rn + half * INTER, mask_n, kb, group, stride_qn,
                                             stride_sn, x_even, SYMMETRIC, BLOCK_N)
                if half == 0:
                    acc_g = tl.dot(x_odd, w_odd, tl.dot(x_even, w_even, acc_g))
                else:
                    acc_u = tl.dot(x_odd, w_odd, tl.dot(x_even, w_even, acc_u))
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(out_ptr + pairs[:, None] * stride_om + rn[None, :], act.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


@jit
def _down_kernel(a_ptr, pairs_ptr, tile_expert_ptr, weights_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
                 TK, N, K, NUM_EXPERTS,
                 stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                 GROUP_SIZE: tl.constexpr, SYMMETRIC: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(1).to(tl.int64)
    e, pairs, mask_m, qw_e, s_e, z_e = _expert_tile(pairs_ptr, tile_expert_ptr, qw_ptr, s_ptr, z_ptr, stride_qe,
                                                    stride_se, TK, BLOCK_M)
    if e < NUM_EXPERTS:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        rb = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + rb
            a_even, a_odd = load_even_odd(a_ptr, pairs, kb, stride_am, 1, mask_m)
            w_even, w_odd = dequant_tile(qw_e, s_e, z_e, rn, mask_n, kb, k0 // GROUP_SIZE, stride_qn, stride_sn,
                                         a_even, SYMMETRIC, BLOCK_N)
            if UPCAST_DOT:
                a_even, a_odd = a_even.to(tl.float32), a_odd.to(tl.float32)
                w_even, w_odd = w_even.to(tl.float32), w_odd.to(tl.float32)
            acc = tl.dot(a_odd, w_odd, tl.dot(a_even, w_even, acc))
        w = tl.load(weights_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)
        tl.store(out_ptr + pairs[:, None] * stride_om + rn[None, :], acc * w[:, None],
                 mask=mask_m[:, None] & mask_n[None, :])


def _block_k(k: int, group_size: int) -> int:
    return min(64, group_size & -group_size, k)


def fused_moe_w4a16_triton(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group_size=128):
    _check(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group_size)
    check(x.dtype in ACT_DTYPES, lambda: f"x dtype must be float16 or bfloat16 for the Triton path, got {x.dtype}")
    require_triton("fused_moe_w4a16")
    x = x.contiguous()
    t, h = x.shape
    k = ids.shape[1]
    e, two_i, _ = w1q.shape
    inter = two_i // 2
    tk = t * k
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if tk == 0:
        return out
    pairs, tile_expert = sort_by_expert(ids, e, BLOCK_M)
    act = torch.empty((tk, inter), dtype=x.dtype, device=x.device)
    rows = torch.zeros((tk, h), dtype=torch.float32, device=x.device)   # pairs never placed (id -1) stay zero
    up = upcast_dot(x.dtype)
    block_n = 64
    _gate_up_kernel[(tile_expert.numel(), cdiv(inter, block_n))](
        x, pairs, tile_expert, w1q, w1s, w1z if w1z is not None else w1s, act,
        tk, h, inter, e, k,
        x.stride(0), w1q.stride(0), w1q.stride(1), w1s.stride(0), w1s.stride(1), act.stride(0),
        GROUP_SIZE=group_size, SYMMETRIC=w1z is None, UPCAST_DOT=up,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=_block_k(h, group_size), num_warps=4, num_stages=3)
    _down_kernel[(tile_expert.numel(), cdiv(h, block_n))](
        act, pairs, tile_expert, weights.reshape(-1).float().contiguous(), w2q, w2s,
        w2z if w2z is not None else w2s, rows,
        tk, h, inter, e,
        act.stride(0), w2q.stride(0), w2q.stride(1), w2s.stride(0), w2s.stride(1), rows.stride(0),
        GROUP_SIZE=group_size, SYMMETRIC=w2z is None, UPCAST_DOT=up,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=_block_k(inter, group_size), num_warps=4, num_stages=3)
    return out.copy_(rows.view(t, k, h).sum(1))
