"""w4a16_gemm: fp16/bf16 activations x INT4 weights packed along K -> [M, N].

qweight [N, K//2] uint8 holds k = 2j in the low nibble of byte j and k = 2j+1 in the high
nibble; scales/zeros [N, K//group_size] fp16, w = (q - zero) * scale (zeros=None: q - 8).
The kernel splits each K tile into its even and odd columns, so every packed byte is
loaded once and dequantized in registers to two [BLOCK_K/2, BLOCK_N] halves; both halves
feed tl.dot with an fp32 accumulator.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from edgeinfer.kernels._triton import cdiv, check, check_tensor, jit, require_triton, tl, upcast_dot

ACT_DTYPES = (torch.float16, torch.bfloat16)


def pack_uint4(q: torch.Tensor) -> torch.Tensor:
    # q: [N, K] integers 0..15 -> [N, K//2] uint8, low nibble = even k
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_uint4(qweight: torch.Tensor) -> torch.Tensor:
    # [N, K//2] uint8 -> [N, K] uint8
    n, k2 = qweight.shape
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(n, k2 * 2)


def group_dequantize_mins(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """The `offset: min` form (GGUF Q4_1): w = q * scale + min in fp32, gguf's own order -> [N, K] float32."""
    q = unpack_uint4(qweight).float()
    n, k = q.shape
    w = q.reshape(n, -1, group_size) * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(n, k)


def group_quantize_tensor(w: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                          clip: torch.Tensor | None = None):
    """w [N, K] float -> (qweight [N, K//2] uint8, scales [N, K//G] fp16, zeros [N, K//G] fp16 | None).

    clip [N, K//G] (optional) shrinks each group's range to [-clip, clip] first (AWQ-style clipping).
    The one implementation of our INT4 layout: backend.quant re-exports it.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size = {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    if clip is not None:
        c = clip.float()[..., None]
        g = torch.maximum(torch.minimum(g, c), -c)
    if symmetric:
        scales = (g.abs().amax(-1) / 7.0).clamp(min=1e-6).half()
        zeros = None
        q = (g / scales.float()[..., None]).round().clamp(-8, 7) + 8
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / 15.0).clamp(min=1e-6).half()
        zeros = (-lo / scales.float()).round().clamp(0, 15).half()
        q = (g / scales.float()[..., None] + zeros.float()[..., None]).round().clamp(0, 15)
    q = q.to(torch.uint8).reshape(n, k)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), scales, zeros


def group_dequantize_tensor(qweight, scales, zeros=None, group_size: int = 128) -> torch.Tensor:
    """Inverse of group_quantize_tensor: -> w [N, K] float32."""
    n, k2 = qweight.shape
    q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(n, k2 * 2).float()
    z = zeros.float() if zeros is not None else torch.full(scales.shape, 8.0, device=scales.device)
    q = q.reshape(n, -1, group_size) - z[..., None]
    return (q * scales.float()[..., None]).reshape(n, k2 * 2)


def w4a16_gemm_reference(x, qweight, scales, zeros=None, group_size=128, out=None):
    # x: [M, K] -> [M, N] in x.dtype
    w = group_dequantize_tensor(qweight, scales, zeros, group_size)
    y = (x.float() @ w.t()).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DECODE = GemmConfig(16, 32, 128, 4, 4)  # M <= 16: weight-bandwidth bound; narrow N tiles fill the SMs
MIDDLE = GemmConfig(64, 64, 64, 4, 3)
PREFILL = GemmConfig(128, 128, 64, 8, 3)  # M >= 256: compute bound, big tiles for reuse


def pick_config(m: int, group_size: int) -> GemmConfig:
    cfg = DECODE if m <= 16 else PREFILL if m >= 256 else MIDDLE
    block_k = min(cfg.block_k, group_size & -group_size)  # a K tile never straddles a group
    return cfg._replace(block_k=block_k)


@jit
def dequant_tile(qw_ptr, s_ptr, z_ptr, rows, mask_n, kb, group, stride_qn, stride_sn, like,
                 SYMMETRIC: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K/2, BLOCK_N] packed bytes of weight rows `rows` at packed columns `kb` (K tile within quantization
    group `group`) -> (even-k weights, odd-k weights), (q - zero) * scale in fp32 rounded once to like's dtype.
    Shared by the W4A16 GEMM and both fused-MoE kernels."""
    packed = tl.load(qw_ptr + rows[None, :] * stride_qn + kb[:, None], mask=mask_n[None, :], other=0)
    scale = tl.load(s_ptr + rows * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
    if SYMMETRIC:
        zero = tl.full((BLOCK_N,), 8.0, tl.float32)
    else:
        zero = tl.load(z_ptr + rows * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
    w_even = (((packed & 0xF).to(tl.float32) - zero[None, :]) * scale[None, :]).to(like.dtype)
    w_odd = (((packed >> 4).to(tl.float32) - zero[None, :]) * scale[None, :]).to(like.dtype)
    return w_even, w_odd


@jit
def load_even_odd(ptr, rows, kb, stride_row, stride_col, mask_rows):
    """Rows `rows` of a row-major activation at the even and the odd columns of packed columns `kb` (the columns
    whose weights one packed byte holds) -> (even, odd), masked rows 0. Shared like dequant_tile."""
    base = ptr + rows[:, None] * stride_row
    even = tl.load(base + (2 * kb)[None, :] * stride_col, mask=mask_rows[:, None], other=0.0)
    odd = tl.load(base + (2 * kb + 1)[None, :] * stride_col, mask=mask_rows[:, None], other=0.0)
    return even, odd


@jit
def _w4a16_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, out_ptr,
                  M, N, K,
                  stride_xm, stride_xk, stride_qn, stride_sn, stride_om,
                  GROUP_SIZE: tl.constexpr, SYMMETRIC: tl.constexpr, UPCAST_DOT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K // 2)  # packed byte within the K tile
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 2 + rb
        x_even, x_odd = load_even_odd(x_ptr, rm, kb, stride_xm, stride_xk, mask_m)
        w_even, w_odd = dequant_tile(qw_ptr, scales_ptr, zeros_ptr, rn, mask_n, kb, k0 // GROUP_SIZE, stride_qn,
                                     stride_sn, x_even, SYMMETRIC, BLOCK_N)
        if UPCAST_DOT:  # interpreter only: its tl.dot multiplies bf16 bit patterns
            x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            w_even, w_odd = w_even.to(tl.float32), w_odd.to(tl.float32)
        acc = tl.dot(x_even, w_even, acc)
        acc = tl.dot(x_odd, w_odd, acc)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _check(x, qweight, scales, zeros, group_size, out) -> None:
    check_tensor("x", x, dtypes=ACT_DTYPES, ndim=2)
    check_tensor("qweight", qweight, dtypes=(torch.uint8,), ndim=2, contiguous=True, device=x.device)
    check_tensor("scales", scales, dtypes=(torch.float16,), ndim=2, contiguous=True, device=x.device)
    m, k = x.shape
    n = qweight.shape[0]
    check(isinstance(group_size, int) and group_size >= 32 and group_size % 32 == 0,
          lambda: f"group_size must be a positive multiple of 32, got {group_size}")
    check(k % group_size == 0, lambda: f"K = {k} (x.shape[1]) must be a multiple of group_size = {group_size}")
    check(qweight.shape[1] * 2 == k, lambda: f"qweight shape {tuple(qweight.shape)} must be [N, K//2] = [N, {k // 2}]")
    check(scales.shape == (n, k // group_size),
          lambda: f"scales shape {tuple(scales.shape)} must be [N, K//group_size] = [{n}, {k // group_size}]")
    if zeros is not None:
        # fp32 zeros: fractional zero points (GGUF Q4_1's mins as -min/scale) kept unrounded
        check_tensor("zeros", zeros, dtypes=(torch.float16, torch.float32), ndim=2, contiguous=True, device=x.device)
        check(zeros.shape == scales.shape, lambda: f"zeros shape {tuple(zeros.shape)} != scales shape {tuple(scales.shape)}")
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), ndim=2, device=x.device)
        check(out.shape == (m, n), lambda: f"out shape {tuple(out.shape)} must be [M, N] = [{m}, {n}]")
        check(out.stride(1) == 1, lambda: f"out must be contiguous along N, got strides {out.stride()}")


def w4a16_gemm_triton(x, qweight, scales, zeros=None, group_size=128, out=None):
    _check(x, qweight, scales, zeros, group_size, out)
    require_triton("w4a16_gemm")
    m, k = x.shape
    n = qweight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = pick_config(m, group_size)
    grid = (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n))
    _w4a16_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, out,
        m, n, k, x.stride(0), x.stride(1), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, SYMMETRIC=zeros is None, UPCAST_DOT=upcast_dot(x.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
