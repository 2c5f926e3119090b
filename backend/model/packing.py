"""Group quantize / dequantize pair (the oracle for kernels.w4a16_gemm) and community INT4 layouts.

Our layout (kernels' contract): q [N, K] in 0..15 packed along K into qweight [N, K//2] uint8
(low nibble = even k); scales, zeros [N, K//G] fp16; w = (q - zero) * scale.
"""

from __future__ import annotations

import torch

from edgeinfer.kernels.w4a16_gemm import (  # noqa: F401 (re-exported: the layout's pair lives with its kernel)
    group_dequantize_mins,
    group_dequantize_tensor,
    group_quantize_tensor,
    pack_uint4,
    unpack_uint4,
)

BITS = 4
QMAX = (1 << BITS) - 1
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)   # AutoAWQ GEMM packs columns [0, 2, 4, 6, 1, 3, 5, 7] per int32


def effective_group_size(k: int, group_size: int) -> int:
    """group_size if it divides K, else the largest multiple of 32 below it that does (576 -> 96 for 128)."""
    if k % group_size == 0:
        return group_size
    for g in range(group_size - group_size % 32, 31, -32):
        if k % g == 0:
            return g
    raise ValueError(f"in_features={k} has no group size that is a multiple of 32, <= {group_size} and divides it")


def fake_quantize(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize (asymmetric), without packing: the search loops' inner step."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if clip is not None:
        c = clip.float()[..., None]
        g = torch.maximum(torch.minimum(g, c), -c)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo) / QMAX).clamp(min=1e-6).half().float()
    z = (-lo / s).round().clamp(0, QMAX)
    return (((g / s + z).round().clamp(0, QMAX) - z) * s).reshape(n, k)


# ---------------------------------------------------------------- community layouts (int32-packed)

def _unpack_int32(x: torch.Tensor) -> torch.Tensor:
    # [R, C] int32 -> [R, C*8] nibbles, nibble i of each word at column 8c + i
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    return ((x.to(torch.int32)[:, :, None] >> shifts) & 0xF).reshape(x.shape[0], -1).to(torch.uint8)


def _unpack_int32_rows(x: torch.Tensor) -> torch.Tensor:
    # [R, C] int32 packed along rows -> [R*8, C], nibble i of row r at row 8r + i
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    return ((x.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, x.shape[1]).to(torch.uint8)


def from_autoawq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """AutoAWQ GEMM: qweight [K, N//8], qzeros [K//G, N//8] int32 (order 0,2,4,6,1,3,5,7), scales [K//G, N]."""
    order = torch.arange(qweight.shape[1] * 8).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    q = _unpack_int32(qweight)[:, order]            # [K, N]
    z = _unpack_int32(qzeros)[:, order]             # [K//G, N]
    return pack_uint4(q.t()), scales.t().contiguous().half(), z.t().contiguous().half()


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group_size: int, zero_offset: int = 1):
    """GPTQ (AutoGPTQ/optimum, checkpoint_format 'gptq'): qweight [K//8, N] packed along K,
    qzeros [K//G, N//8] packed along N, stored zero = zero - 1 (zero_offset=1; 0 for 'gptq_v2')."""
    q = _unpack_int32_rows(qweight)                 # [K, N]
    k = q.shape[0]
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64).cpu(), torch.arange(k) // group_size):
        raise ValueError("act-order (desc_act) g_idx permutations are not supported; re-export with desc_act=false")
    z = _unpack_int32(qzeros).to(torch.int16) + zero_offset   # [K//G, N]; v1 zeros may read 16
    return pack_uint4(q.t()), scales.t().contiguous().half(), z.t().contiguous().half()


def from_compressed_tensors(packed: torch.Tensor, scales: torch.Tensor, shape: torch.Tensor):
    """compressed-tensors pack-quantized, symmetric int4: weight_packed [N, K//8] int32 with element i of a row at
    bits 4i and stored as q + 8, weight_scale [N, K//G]: w = q * s = (u - 8) * s, our symmetric form. The nibbles
    are already ours (low nibble = even k): only unpacked and repacked, never re-rounded. Scales (bf16 in Kimi's
    files) become fp16, which holds every bf16 value in fp16's normal range exactly."""
    n, k = (int(x) for x in shape.tolist())
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, k // 8) or k % 8:
        raise ValueError(f"weight_packed {packed.dtype} {tuple(packed.shape)} does not hold weight_shape {(n, k)} "
                         f"(expected int32 [{n}, {k // 8}])")
    q = _unpack_int32(packed)[:, :k]                # [N, K], element order = k
    s = scales.to(torch.float16)
    if not torch.isfinite(s).all() or not torch.equal(s.float(), scales.float()):
        raise ValueError(f"weight_scale ({scales.dtype}) has values fp16 cannot hold exactly "
                         f"(range {float(scales.float().abs().min()):.3g} .. {float(scales.float().abs().max()):.3g})")
    return pack_uint4(q), s.contiguous(), None


def to_autoawq_gemm(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """Our layout -> AutoAWQ GEMM tensors (used by tests and for export)."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def pack_cols(v: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C//8] int32
        v = v.to(torch.int64).view(v.shape[0], -1, 8)[:, :, list(order)]
        out = torch.zeros(v.shape[:2], dtype=torch.int64)
        for i in range(8):
            out |= v[:, :, i] << (4 * i)
        return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)

    q = unpack_uint4(qweight).t()
    return pack_cols(q), pack_cols(zeros.t().round()), scales.t().contiguous()


def to_gptq(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    """Our layout -> GPTQ v1 tensors (qweight, qzeros, scales, g_idx)."""
    def to_i32(v: torch.Tensor) -> torch.Tensor:
        return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)

    q = unpack_uint4(qweight).t().to(torch.int64)           # [K, N]
    k, n = q.shape
    qr = q.view(k // 8, 8, n)
    packed = torch.zeros((k // 8, n), dtype=torch.int64)
    for i in range(8):
        packed |= qr[:, i] << (4 * i)
    z = ((zeros.t().round().to(torch.int64) - 1) & 0xF).view(-1, n // 8, 8)   # v1 cannot store zero 0
    qz = torch.zeros(z.shape[:2], dtype=torch.int64)
    for i in range(8):
        qz |= z[:, :, i] << (4 * i)
    return to_i32(packed), to_i32(qz), scales.t().contiguous(), torch.arange(k, dtype=torch.int32) // group_size
