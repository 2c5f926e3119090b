"""GGUF quantized blocks -> our layouts, without requantizing (the values are the file's, bit for bit).

A GGUF row of K weights is K/32 blocks; in a 4-bit block byte j holds q[j] (low nibble) and q[j + 16]
(high nibble). Ours packs along K with the low nibble = even k (backend.model.packing), so the nibbles are
re-ordered, never re-rounded:

  Q4_0  [d fp16][16 B]  w = d * (q - 8)   -> qweight, scales = d (symmetric: zero 8)
  Q4_1  [d][m fp16][16 B]  w = d * q + m   -> qweight, scales = d, mins = m   (w = q * scale + min)
  Q8_0  [d fp16][32 x int8]  w = d * q     -> int8 [N, K], scales = d [N, K/32]
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 2 + BLOCK // 2, "Q4_1": 4 + BLOCK // 2, "Q8_0": 2 + BLOCK}
NATIVE_TYPES = tuple(BLOCK_BYTES)


class BlockError(ValueError):
    pass


def _blocks(data: np.ndarray, kind: str, n: int, k: int) -> np.ndarray:
    """Raw bytes (any shape) -> [n, k/32, bytes per block] uint8."""
    if k % BLOCK:
        raise BlockError(f"{kind}: row length {k} is not a multiple of the block size {BLOCK}")
    want = n * (k // BLOCK) * BLOCK_BYTES[kind]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size != want:
        raise BlockError(f"{kind}: {raw.size} bytes for a [{n}, {k}] tensor, expected {want}")
    return raw.reshape(n, k // BLOCK, BLOCK_BYTES[kind])


def _f16(b: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].copy())


def _nibbles_to_ours(qs: np.ndarray, n: int, k: int) -> torch.Tensor:
    # qs [n, k/32, 16]: byte j = q[j] | q[j+16] << 4  ->  q [n, k] -> ours [n, k/2]: q[2j] | q[2j+1] << 4
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return torch.from_numpy(np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)))


def q4_0(data: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> qweight [n, k/2] uint8, scales [n, k/32] fp16 (zero point 8)."""
    b = _blocks(data, "Q4_0", n, k)
    return _nibbles_to_ours(b[..., 2:], n, k), _f16(b, 0)


def q4_1(data: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> qweight [n, k/2] uint8, scales [n, k/32] fp16, mins [n, k/32] fp16."""
    b = _blocks(data, "Q4_1", n, k)
    return _nibbles_to_ours(b[..., 4:], n, k), _f16(b, 0), _f16(b, 2)


def q8_0(data: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> q [n, k] int8, scales [n, k/32] fp16."""
    b = _blocks(data, "Q8_0", n, k)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
    return torch.from_numpy(q.copy()), _f16(b, 0)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 [n, k] and per-32 scales -> fp32 [n, k], as gguf computes it (x * d in fp32: exact)."""
    n, k = q.shape
    return (q.float().reshape(n, -1, BLOCK) * scales.float()[..., None]).reshape(n, k)
