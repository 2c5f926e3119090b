"""Linear layers: dense, and INT4 weight-only (w4a16) through kernels.w4a16_gemm."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # [out, in]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class W4A16Linear(nn.Module):
    """qweight [out, in//2] uint8 (low nibble = even k), scales/zeros [out, in//group] fp16."""

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
