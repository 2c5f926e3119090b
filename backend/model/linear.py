"""Linear layers: dense (optionally prepacked for oneDNN on CPU), and INT4 weight-only (w4a16)
through kernels.w4a16_gemm."""

from __future__ import annotations

import os

import torch
from torch import nn

import kernels

PREPACK_ENV = "EDGEINFER_CPU_PREPACK"
PREPACK_BATCH_HINT = 64   # oneDNN picks its blocking for this many rows (a hint of 1 was 2x slower at 32 rows)


def cpu_prepack_enabled() -> bool:
    """EDGEINFER_CPU_PREPACK=0|1 (default 1); any other value is an error, not a silent default."""
    value = os.environ.get(PREPACK_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PREPACK_ENV}={value!r}; expected 0 or 1")
    return value == "1"


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class DenseLinear(nn.Module):
    """y = x @ W.T + b. On CPU, `prepack()` swaps W for oneDNN's blocked layout: the same fp32/bf16
    math, 2-3x faster at 8-64 rows than the plain-layout GEMM (benchmarks/bench_engine.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        # [out, in]; None once prepacked
        self.weight: nn.Parameter | None = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.packed: torch.Tensor | None = None                   # oneDNN layout, not a parameter
        self._shape = tuple(weight.shape)
        self._nbytes = weight.numel() * weight.element_size()

    @property
    def out_features(self) -> int:
        return self._shape[0]

    def weight_bytes(self) -> int:
        return self._nbytes

    def prepack(self, batch_hint: int = PREPACK_BATCH_HINT) -> bool:
        """Replace the plain weight by a prepacked copy (frees the plain one unless it is shared,
        e.g. tied embeddings). Returns False, changing nothing, where oneDNN can't take it."""
        if self.packed is not None:
            return True
        if self.weight is None or not can_prepack(self.weight):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data.contiguous(), batch_hint)
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None   # only prepack() drops it, after setting packed
            return nn.functional.linear(x, self.weight, self.bias)
        # x: [..., in] -> [..., out]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self._shape[1]), self.packed, self.bias,
                                               "none", [], "")
        return y.reshape(*x.shape[:-1], self._shape[0])


class W4A16Linear(nn.Module):
    """qweight [out, in//2] uint8 (low nibble = even k), scales/zeros [out, in//group] fp16."""

    qweight: torch.Tensor         # buffers (register_buffer in __init__)
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group_size = group_size
        self._dense_cache: torch.Tensor | None = None
        self.compute_dtype = compute_dtype

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def weight_bytes(self) -> int:
        n = self.qweight.numel() + self.scales.numel() * self.scales.element_size()
        if self.zeros is not None:
            n += self.zeros.numel() * self.zeros.element_size()
        return n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cuda:
            y = kernels.w4a16_gemm(x.reshape(-1, x.shape[-1]), self.qweight, self.scales, self.zeros,
                                   self.group_size).reshape(*x.shape[:-1], -1)
        else:
            y = kernels.w4a16_gemm(x, self.qweight, self.scales, self.zeros, self.group_size)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.to(dtype)
