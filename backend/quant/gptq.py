"""GPTQ-style rounding: quantize columns left to right, pushing each column's error onto the
columns not yet quantized through the inverse Hessian H^-1 (H = X^T X of the calibration inputs).

Groups run along K, so a block of GPTQ columns is one quantization group; each group's scale and
zero are taken from the already-updated weights when the group starts (no act-order).
"""

from __future__ import annotations

import torch

from edgeinfer.backend.model.packing import QMAX, pack_uint4

DAMP = 0.1


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, clip: torch.Tensor | None = None):
    """w [N, K], h [K, K] -> (qweight [N, K//2] uint8, scales [N, K//G] fp16, zeros [N, K//G] fp16)."""
    w = w.float().clone()
    n, k = w.shape
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += DAMP * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q_all = torch.zeros((n, k), dtype=torch.uint8)
    ng = k // group_size
    scales = torch.zeros((n, ng), dtype=torch.float16)
    zeros = torch.zeros((n, ng), dtype=torch.float16)
    for gi in range(ng):
        i1, i2 = gi * group_size, (gi + 1) * group_size
        w1 = w[:, i1:i2].clone()
        g = w1
        if clip is not None:
            c = clip[:, gi:gi + 1].float()
            g = torch.maximum(torch.minimum(w1, c), -c)
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / QMAX).clamp(min=1e-6).half()
        z = (-lo / s.float()).round().clamp(0, QMAX).half()
        scales[:, gi], zeros[:, gi] = s, z
        sf, zf = s.float(), z.float()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(group_size):
            col = w1[:, i]
            q = (col / sf + zf).round().clamp(0, QMAX)
            q_all[:, i1 + i] = q.to(torch.uint8)
            e = (col - (q - zf) * sf) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return pack_uint4(q_all), scales, zeros
