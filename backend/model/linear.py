"""Linear layers: dense (optionally prepacked for oneDNN on CPU), and INT4 weight-only (w4a16)
through kernels.w4a16_gemm."""

from __future__ import annotations

import os

import torch
from torch import nn

import edgeinfer.kernels.cpu as cpu_kernels
from edgeinfer import kernels
from edgeinfer.backend.model.gguf_blocks import dequantize_int8
from edgeinfer.backend.model.packing import group_dequantize_mins, unpack_uint4

PREPACK_ENV = "EDGEINFER_CPU_PREPACK"
PREPACK_BATCH_HINT = 64   # oneDNN picks its blocking for this many rows (a hint of 1 was 2x slower at 32 rows)
DENSE_MIN_ROWS = 1 << 30  # from this many rows kernels.cpu would dequantize to a scratch fp32 weight and run a GEMM;
                          # the interleaved (x8) int8 kernel beat that at every row count measured (1 .. 2048:
                          # benchmarks/kernels/cpu.py, docs/KERNELS.md), so in effect never
HEAD_DENSE_MIN_ROWS = 1 << 30  # the same for the Q8_0 head (x8 int8 dots vs chunked dequantize + GEMM)
HEAD_CHUNK = 4096
HEAD_EXACT_CHANNELS = 2   # activation channels a Q8Linear head keeps out of its int8 quantization (docs/QUANTIZATION.md)


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
    math, 2-3x faster at 8-64 rows than the plain-layout GEMM (benchmarks/engine/vs_transformers.py)."""

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

    @property
    def prepacked(self) -> bool:
        return self.packed is not None

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


def kernel_takes(x: torch.Tensor) -> bool:
    """CUDA fp16/bf16 activations go through the W4A16 GEMM kernel (Q4_1's mins too, as zero points)."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def mins_as_zeros(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w = q * s + m (GGUF Q4_1) as w = (q - z) * s': z = -m / s in fp32. A block with s = 0 (every weight = m)
    gets s' = 2^-24 (fp16's smallest), off from m by at most 15 * 2^-24 per weight."""
    s = torch.where(scales == 0, torch.full_like(scales, 2.0 ** -24), scales)
    return s.contiguous(), (-mins.float() / s.float()).contiguous()


INT4_CPU_GROUPS = (256, 128, 64, 32)   # group sizes torch's CPU int4 GEMM takes


def int4_cpu_group(group_size: int) -> int | None:
    """The largest group the CPU int4 GEMM takes that divides `group_size` (a group of 96 is three groups
    of 32 with the same scale and zero point: exact), or None."""
    return next((g for g in INT4_CPU_GROUPS if group_size % g == 0), None)


class W4A16Linear(nn.Module):
    """qweight [out, in//2] uint8 (low nibble = even k), scales/zeros [out, in//group] fp16; w = (q - zero) * scale.
    Or, with `mins` instead of zeros (GGUF Q4_1, exact): w = q * scale + min.

    On CUDA: kernels.w4a16_gemm (Triton). On CPU the reference dequantizes the whole weight every call;
    `prepack()` instead packs the `mins` form (group a multiple of 32) once into GGUF Q4_1 blocks with 8 rows
    interleaved (kernels.cpu.pack_q4_1x8) for kernels.cpu (activations quantized to int8 per 32, integer dots,
    as llama.cpp's repacked Q4_0_8x8; from DENSE_MIN_ROWS rows a dequantize into a reused scratch buffer then a
    dense GEMM), or, where those are off or unavailable
    (kernels.cpu.MODE_ENV) and for the `zeros` form, repacks it once for torch's CPU int4 GEMM (`_weight_int4pack_mm_for_cpu`, as
    gpt-fast/torchao use): still 4 bits a weight in memory, activations through it in bf16 and the fp16
    scales and zero points rounded to bf16 (the op's format: w = (q - 8) * s + z', z' = (8 - zero) * s,
    or z' = min + 8 * s).
    A group the op does not take (96) runs as sub-groups it does (3 x 32, same scale and zero point).
    """

    qweight: torch.Tensor         # buffers (register_buffer in __init__); None once prepacked
    scales: torch.Tensor
    zeros: torch.Tensor | None
    mins: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None,
                 mins: torch.Tensor | None = None) -> None:
        super().__init__()
        if zeros is not None and mins is not None:
            raise ValueError("W4A16Linear takes zeros or mins, not both")
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("mins", mins)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group_size = group_size
        self.compute_dtype = compute_dtype
        self._shape = (qweight.shape[0], qweight.shape[1] * 2)       # [out, in]
        self._nbytes = self._bytes()
        self.int4pack: torch.Tensor | None = None                    # CPU: torch's packed int4 layout
        self.scales_and_zeros: torch.Tensor | None = None            # [in//op_group, out, 2] bf16
        self._op_group = group_size                                    # group the CPU int4 GEMM runs with
        self.q4_1x8: torch.Tensor | None = None                      # CPU: [ceil(out/8), in//32 * 160] for kernels.cpu
        self.residual_activations = False   # q4_1x8: activations in two int8 passes (kernels.cpu.activations())
        self.second_pass_tau = 0.0          # ... the second on the blocks of scale >= this x the row's largest
        self._kernel_form: tuple[torch.Tensor, torch.Tensor] | None = None   # CUDA, with mins: (scales, zeros)

    @property
    def out_features(self) -> int:
        return self._shape[0]

    def _bytes(self) -> int:
        n = self.qweight.numel() + self.scales.numel() * self.scales.element_size()
        for t in (self.zeros, self.mins):
            if t is not None:
                n += t.numel() * t.element_size()
        return n

    def weight_bytes(self) -> int:
        return self._nbytes

    @property
    def prepacked(self) -> bool:
        return self.int4pack is not None or self.q4_1x8 is not None

    def prepack(self) -> bool:
        """CPU only: pack for kernels.cpu (mins form) or torch's int4 CPU GEMM and free the original buffers.
        False, changing nothing, where the op, the device or the group size does not allow it."""
        if self.prepacked:
            return True
        if (self.mins is not None and self.group_size % cpu_kernels.BLOCK == 0 and self.qweight.device.type == "cpu"
                and cpu_kernels.enabled()):
            self.q4_1x8 = cpu_kernels.pack_q4_1x8(
                cpu_kernels.pack_q4_1(self.qweight, self.scales, self.mins, self.group_size))
            self.residual_activations = cpu_kernels.activations() == "int8x2"
            self.second_pass_tau = cpu_kernels.second_pass_tau()
            self.qweight = self.scales = self.mins = None  # type: ignore[assignment]
            return True
        group = int4_cpu_group(self.group_size)
        if self.qweight.device.type != "cpu" or group is None or not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            return False
        n, k = self._shape
        q = unpack_uint4(self.qweight).to(torch.int32)       # [out, in] in 0..15
        # s, z: [out, in // group_size] -> [out, in // group], each repeated over the sub-groups
        s = self.scales.float().repeat_interleave(self.group_size // group, dim=1)
        if self.mins is not None:
            offset = self.mins.float().repeat_interleave(self.group_size // group, dim=1) + 8.0 * s
        elif self.zeros is not None:
            offset = (8.0 - self.zeros.float().repeat_interleave(self.group_size // group, dim=1)) * s
        else:
            offset = torch.zeros_like(s)
        try:
            packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            sz = torch.stack([s, offset], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
            torch._weight_int4pack_mm_for_cpu(torch.zeros(1, k, dtype=torch.bfloat16), packed, group, sz)
        except (RuntimeError, NotImplementedError):   # this build/CPU/shape: keep the reference path
            return False
        self.int4pack, self.scales_and_zeros, self._op_group = packed, sz, group
        self.qweight = self.scales = None  # type: ignore[assignment]
        self.zeros = self.mins = None
        return True

    def _scales_zeros_for_kernel(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scales, zeros) in the GEMM kernel's (q - zero) * scale form; with mins, computed once (kernel_form):
        zero = -min / scale in fp32."""
        if self.mins is None:
            return self.scales, self.zeros
        if self._kernel_form is None:
            self._kernel_form = mins_as_zeros(self.scales, self.mins)
        return self._kernel_form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.q4_1x8 is not None:
            n, k = self._shape
            flat = x.dim() == 2 and dtype == torch.float32 and x.is_contiguous()   # the CPU step's rows: as they are
            x2 = x if flat else x.reshape(-1, k).to(torch.float32).contiguous()  # [rows, in] -> [rows, out]
            if x2.shape[0] < DENSE_MIN_ROWS:
                if self.residual_activations:
                    y = cpu_kernels.q4_1x8_gemm_residual(x2, self.q4_1x8, n, self.second_pass_tau)
                else:
                    y = cpu_kernels.q4_1x8_gemm(x2, self.q4_1x8, n)
            else:
                y = x2 @ cpu_kernels.q4_1x8_dequant(self.q4_1x8, n, cpu_kernels.scratch(n, k)).t()
            if flat and self.bias is None:
                return y
            y = y.reshape(*x.shape[:-1], n)
        elif self.int4pack is not None:
            assert self.scales_and_zeros is not None   # set together with int4pack
            # x: [..., in] -> [..., out]
            y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self._shape[1]).to(torch.bfloat16), self.int4pack,
                                                  self._op_group, self.scales_and_zeros)
            y = y.reshape(*x.shape[:-1], self._shape[0])
        elif self.mins is not None and not kernel_takes(x):   # the exact fp32 weight (gguf's own dequantization)
            w = group_dequantize_mins(self.qweight, self.scales, self.mins, self.group_size)
            y = (x.reshape(-1, self._shape[1]).float() @ w.t()).reshape(*x.shape[:-1], self._shape[0])
        elif kernel_takes(x):
            scales, zeros = self._scales_zeros_for_kernel()
            y = kernels.w4a16_gemm(x.reshape(-1, x.shape[-1]), self.qweight, scales, zeros,
                                   self.group_size).reshape(*x.shape[:-1], -1)
        else:
            y = kernels.w4a16_gemm(x, self.qweight, self.scales, self.zeros, self.group_size)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(dtype)


class Q8Embedding(nn.Module):
    """A GGUF Q8_0 embedding held as int8 [vocab, hidden] + fp16 scales per 32 (a quarter of fp32's bytes);
    `index_select` dequantizes only the looked-up rows, exactly as gguf does (int8 * scale in fp32)."""

    qweight: torch.Tensor   # buffers (register_buffer in __init__)
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self._dtype = dtype
        self._shape = qweight.shape
        self.interleaved = False   # True once interleave() holds the table in kernels.cpu's x8 layout

    def interleave(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold the table in kernels.cpu's x8 layout (pack_q8_0x8) instead of the plain one, so a tied Q8Linear
        head reads the same bytes (one copy): lookups then gather their rows from it. Returns (qs, d)."""
        if not self.interleaved:
            self.qweight, self.scales = cpu_kernels.pack_q8_0x8(self.qweight, self.scales)
            self.interleaved = True
        return self.qweight, self.scales

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.interleaved:
            q, s = cpu_kernels.q8_0x8_rows(self.qweight, self.scales, rows, n=self._shape[0])
            return dequantize_int8(q, s).to(self._dtype)
        q = self.qweight if rows is None else self.qweight.index_select(0, rows)
        s = self.scales if rows is None else self.scales.index_select(0, rows)
        return dequantize_int8(q, s).to(self._dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError(f"Q8Embedding.index_select: dim={dim}, only rows (0)")
        return self.dequantize(index)


class Q8Linear(nn.Module):
    """y = x @ W.T for a GGUF Q8_0 table on kernels.cpu's int8 dots, held in its x8 layout (qs, d: 8 rows
    interleaved, kernels.cpu.pack_q8_0x8), with the activations quantized to int8 per 32 (llama.cpp's Q8_0 x
    Q8_1) except the few channels keep_exact() names (fp32 against exact weight columns): the tied head of a Q8_0 embedding, sharing its (interleaved) buffers: a quarter of the fp32 copy's
    bytes read per step, no copy held. From HEAD_DENSE_MIN_ROWS rows it dequantizes HEAD_CHUNK rows at a time
    into a scratch buffer and runs fp32 GEMMs instead."""

    qs: torch.Tensor
    d: torch.Tensor
    exact_idx: torch.Tensor | None
    exact_w: torch.Tensor | None

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, out_features: int) -> None:
        super().__init__()
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self._n = out_features
        # buffers (counted in the model's weight_bytes): the channels kept out of the int8 activations
        # (keep_exact) and their exact fp32 weight columns [ceil(n/8), C, 8]; None: plain int8 activations
        self.register_buffer("exact_idx", None)
        self.register_buffer("exact_w", None)

    def keep_exact(self, channels: torch.Tensor | None) -> None:
        """Take these activation channels out of the int8 quantization: they are zeroed before it (so an outlier
        no longer sets its block's scale) and added back in fp32 against the table's exactly dequantized
        columns (C * out * 4 bytes held). None: back to plain int8 activations."""
        if channels is None or channels.numel() == 0:
            self.exact_idx = self.exact_w = None
            return
        idx = channels.to(torch.int64).sort().values.contiguous()
        self.exact_w = cpu_kernels.q8_0x8_columns(self.qs, self.d, idx)
        self.exact_idx = idx

    @classmethod
    def from_plain(cls, qweight: torch.Tensor, scales: torch.Tensor) -> Q8Linear:
        """From int8 [out, in] + fp16 scales [out, in/32] (packed into a new x8 copy)."""
        return cls(*cpu_kernels.pack_q8_0x8(qweight, scales), qweight.shape[0])

    @classmethod
    def tied_to(cls, embed: Q8Embedding) -> Q8Linear:
        """The head on the embedding's own table (interleaved in place: one copy for both)."""
        return cls(*embed.interleave(), embed.shape[0])

    @property
    def out_features(self) -> int:
        return self._n

    @property
    def prepacked(self) -> bool:
        return False            # holds no copy beyond its (shared) buffers, counted by the model once

    def weight_bytes(self) -> int:
        extra = 0 if self.exact_w is None else self.exact_w.numel() * 4
        return self.qs.numel() + self.d.numel() * self.d.element_size() + extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out] fp32
        n, k = self._n, self.qs.shape[1] // 256 * 32
        x2 = x.reshape(-1, k).to(torch.float32).contiguous()
        if x2.shape[0] < HEAD_DENSE_MIN_ROWS:
            if self.exact_idx is not None:
                assert self.exact_w is not None   # set together
                y = cpu_kernels.q8_0x8_gemm_exact(x2, self.qs, self.d, n, self.exact_idx, self.exact_w)
            else:
                y = cpu_kernels.q8_0x8_gemm(x2, self.qs, self.d, n)
        else:   # dequantize a chunk of rows into the scratch buffer, fp32 GEMM, next chunk
            y = torch.empty(x2.shape[0], n)
            for r in range(0, n, HEAD_CHUNK):
                w = cpu_kernels.q8_0x8_dequant(self.qs, self.d, r, cpu_kernels.scratch(min(HEAD_CHUNK, n - r), k))
                y[:, r: r + w.shape[0]] = x2 @ w.t()
        return y.reshape(*x.shape[:-1], n)
