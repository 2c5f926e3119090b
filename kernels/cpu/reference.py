"""Pure-torch references of kernels.cpu's ops, same signatures. q8_quantize reproduces the C++ activation
quantization bit for bit (fp32 amax / 127, 1 / d, round half to even); the GEMMs sum the same integer block
dots in float64, so the C++ results differ from these only by fp32 accumulation order."""

from __future__ import annotations

import torch

from edgeinfer.kernels.cpu import q8_0x8_rows, unpack_q4_1x8

BLOCK = 32


def q8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).to(torch.int8)
    s = d * q.sum(-1, dtype=torch.int32).float()
    return q.reshape(m, k), d, s


def unpack_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks [N, nb * 20] -> q [N, nb, 32] uint8 in k order, d and m [N, nb] fp32."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 20)
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    qs = b[..., 4:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1), d, m


def q4_1_gemm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return _q4_1_gemm_quantized(blocks, *q8_quantize(x))


def _q4_1_gemm_quantized(blocks: torch.Tensor, qy: torch.Tensor, dy: torch.Tensor, sy: torch.Tensor) -> torch.Tensor:
    """The GEMM on activations already quantized: qy [M, K] integer values (int8, or int32 for two passes)."""
    q, d, mn = unpack_q4_1(blocks)
    mrows = qy.shape[0]
    dots = torch.einsum("mbk,nbk->mnb", qy.reshape(mrows, -1, BLOCK).double(), q.double())   # exact integers
    scale = (dy[:, None, :] * d[None]).double()               # fp32 product, as the kernel takes it
    return ((dots * scale).sum(-1) + (mn[None] * sy[:, None, :]).double().sum(-1)).float()


def q8_0_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    qy, dy, _ = q8_quantize(x)
    mrows, n = x.shape[0], qweight.shape[0]
    dots = torch.einsum("mbk,nbk->mnb", qy.reshape(mrows, -1, BLOCK).double(),
                        qweight.reshape(n, -1, BLOCK).double())
    return (dots * (dy[:, None, :] * scales.float()[None]).double()).sum(-1).float()


def q4_1_dequant(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    q, d, m = unpack_q4_1(blocks)
    out.copy_((q.float() * d[..., None] + m[..., None]).reshape(out.shape))
    return out


def q8_0_dequant(qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n, k = qweight.shape
    out.copy_((qweight.float().reshape(n, -1, BLOCK) * scales.float()[..., None]).reshape(n, k))
    return out


def q4_1x8_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return q4_1_gemm(x, unpack_q4_1x8(packed, n))


def q8_quantize_x2(x: torch.Tensor, tau: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-pass activations as kernels/cpu/q4.cpp's quantize_rows_x2 makes them, as one integer per value:
    q8_quantize(x) = (q, d1, s), then q2 = round((x - d1 * q) / (d1 / 256)) clamped to +-127 on the blocks whose
    d1 >= tau * the row's largest (all non-zero blocks for tau 0); such a block is 256 * q + q2 at scale d1 / 256
    with s = (d1 / 256) * sum(256 * q + q2). Returns (values int32 [M, K], d [M, K/32], s [M, K/32])."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"q4_1x8_gemm_residual: tau must be in [0, 1], got {tau}")
    m, k = x.shape
    q, d, s = q8_quantize(x)
    xb, qb = x.float().reshape(m, -1, BLOCK), q.reshape(m, -1, BLOCK)
    sel = d != 0
    if tau > 0 and m:
        sel &= d >= torch.tensor(tau, dtype=torch.float32) * d.amax(-1, keepdim=True)
    step = d / 256.0
    inv = torch.where(sel, 1.0 / torch.where(sel, step, torch.ones_like(step)), torch.zeros_like(step))
    rest = xb - qb.float() * d[..., None]
    q2 = torch.round(rest * inv[..., None]).clamp(-127, 127).to(torch.int32)
    both = qb.to(torch.int32) * 256 + q2
    vals = torch.where(sel[..., None], both, qb.to(torch.int32))
    d2 = torch.where(sel, step, d)
    s2 = torch.where(sel, step * both.sum(-1).float(), s)
    return vals.reshape(m, k), d2, s2


def q4_1x8_gemm_residual(x: torch.Tensor, packed: torch.Tensor, n: int, tau: float = 0.0) -> torch.Tensor:
    """x in two int8 passes (q8_quantize_x2), each block's two integer dots combined exactly (256 * hi + lo)."""
    return _q4_1_gemm_quantized(unpack_q4_1x8(packed, n), *q8_quantize_x2(x, tau))


def q4_1x8_moe_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, offsets: torch.Tensor,
                    residual: bool, tau: float = 0.0) -> torch.Tensor:
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for e in range(packed.shape[0]):
        r0, r1 = int(offsets[e]), int(offsets[e + 1])
        if r1 > r0:
            out[r0:r1] = (q4_1x8_gemm_residual(x[r0:r1], packed[e], n, tau) if residual
                          else q4_1x8_gemm(x[r0:r1], packed[e], n))
    return out


def q4_1x8_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gu: torch.Tensor, w_dn: torch.Tensor,
               inter: int, residual: bool, tau: float = 0.0) -> torch.Tensor:
    t, k = ids.shape
    flat = ids.reshape(-1)
    valid = flat >= 0                               # -1: the expert is on another rank (expert parallelism)
    order = torch.argsort(torch.where(valid, flat, w_gu.shape[0]), stable=True)[: int(valid.sum())]
    offsets = torch.zeros(w_gu.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(flat[valid], minlength=w_gu.shape[0]).cumsum(0)
    h = q4_1x8_moe_gemm(x[order // k].contiguous(), w_gu, 2 * inter, offsets, residual, tau)
    act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).contiguous()
    rows = q4_1x8_moe_gemm(act, w_dn, x.shape[1], offsets, residual, tau)
    by_pair = torch.zeros(t * k, x.shape[1])
    by_pair[order] = rows
    return (by_pair.view(t, k, -1) * torch.where(valid.view(t, k), weights, 0.0)[:, :, None]).sum(1)


def q8_0x8_gemm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
    return q8_0_gemm(x, *q8_0x8_rows(qs, d, n=n))


def q8_0x8_gemm_exact(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, n: int, idx: torch.Tensor,
                      wo: torch.Tensor) -> torch.Tensor:
    xz = x.clone()
    xz[:, idx] = 0.0
    exact = x[:, idx].double() @ wo.transpose(1, 2).reshape(-1, idx.numel())[:n].double().t()   # [M, n]
    return (q8_0x8_gemm(xz, qs, d, n).double() + exact).float()


def q4_1x8_dequant(packed: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    return q4_1_dequant(unpack_q4_1x8(packed, n), out)


def q8_0x8_dequant(qs: torch.Tensor, d: torch.Tensor, row0: int, out: torch.Tensor) -> torch.Tensor:
    q, s = q8_0x8_rows(qs, d, torch.arange(row0, row0 + out.shape[0]))
    return q8_0_dequant(q, s, out)
