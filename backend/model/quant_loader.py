"""Build W4A16Linear modules from a quantized checkpoint (edgeinfer, AutoAWQ GEMM or GPTQ layouts), and the
embedding of one that stores it as GGUF Q8_0 blocks (int8 + per-32 scales).

The model fuses q/k/v and gate/up: each HF prefix is converted to our layout, then the parts are
concatenated along the output dim (groups run along K, so concatenating rows keeps them intact).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from edgeinfer.backend.model.linear import DenseLinear, Q8Embedding, W4A16Linear
from edgeinfer.backend.model.model_config import CheckpointError, ModelConfig
from edgeinfer.backend.model.packing import (
    effective_group_size,
    from_autoawq_gemm,
    from_compressed_tensors,
    from_gptq,
)
from edgeinfer.backend.model.quant_format import QuantConfig

Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _to_our_layout(qc: QuantConfig, name: str, k: int, take: Callable[[str], torch.Tensor],
                   tensors: dict[str, torch.Tensor]) -> Packed:
    if qc.layout == "edgeinfer":
        offset = (name + (".mins" if qc.offset == "min" else ".zeros")) if qc.zero_point else None
        return take(name + ".qweight"), take(name + ".scales"), take(offset) if offset else None
    if qc.layout == "compressed-tensors":
        return from_compressed_tensors(take(name + ".weight_packed"), take(name + ".weight_scale"),
                                       take(name + ".weight_shape"))
    qweight, qzeros, scales = take(name + ".qweight"), take(name + ".qzeros"), take(name + ".scales")
    if qc.layout == "awq-gemm":
        return from_autoawq_gemm(qweight, qzeros, scales)
    return from_gptq(qweight, qzeros, scales, tensors.get(name + ".g_idx"), k // scales.shape[0],
                     zero_offset=1 if qc.layout == "gptq" else 0)


def quantized_linear_factory(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                             device: torch.device, source: str = ""):
    """-> make_linear(names, shapes, bias=False) building one fused W4A16Linear per call."""
    qc = QuantConfig.from_dict(cfg.quantization, cfg.source or f"{source}/config.json")
    if device.type == "cuda" and dtype not in (torch.float16, torch.bfloat16):
        raise CheckpointError(f"{source}: INT4 weights on CUDA need dtype bfloat16 or float16, got {dtype}")

    def take(name: str) -> torch.Tensor:   # popped: the fused copy is built from it, the load's peak drops
        if name not in tensors:
            raise CheckpointError(f"{source}: missing tensor {name!r} (quant_method {qc.quant_method!r})")
        return tensors.pop(name)

    def make_linear(names: list[str], shapes: list[tuple[int, int]], bias: bool = False) -> nn.Module:
        has_q = [n + qc.qweight_suffix in tensors for n in names]
        bs = [take(n + ".bias").to(device=device, dtype=dtype) for n in names] if bias else None
        if not any(has_q) and all(n + ".weight" in tensors for n in names):   # a module left unquantized
            w = torch.cat([take(n + ".weight") for n in names]).to(device=device, dtype=dtype)
            return DenseLinear(w.contiguous(), torch.cat(bs) if bs else None)
        if not all(has_q):
            missing = [n for n, q in zip(names, has_q) if not q]
            raise CheckpointError(f"{source}: fused modules must all be quantized; no {qc.qweight_suffix[1:]} for "
                                  f"{missing}")
        parts: list[Packed] = []
        group: int | None = None
        for name, (n_out, k) in zip(names, shapes):
            try:
                qweight, scales, zeros = _to_our_layout(qc, name, k, take, tensors)
            except (ValueError, RuntimeError) as e:
                raise CheckpointError(f"{source}: cannot unpack {name!r} ({qc.quant_method}): {e}") from e
            want_g = effective_group_size(k, qc.group_size)
            if tuple(qweight.shape) != (n_out, k // 2) or tuple(scales.shape) != (n_out, k // want_g):
                raise CheckpointError(
                    f"{source}: {name!r} unpacks to qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}; "
                    f"expected [{n_out}, {k // 2}] and [{n_out}, {k // want_g}] (group_size {want_g})")
            if zeros is not None and zeros.shape != scales.shape:
                raise CheckpointError(f"{source}: {name!r} {qc.offset}s shape {tuple(zeros.shape)} != scales "
                                      f"{tuple(scales.shape)}")
            parts.append((qweight, scales, zeros))
            group = want_g
        qweight = torch.cat([p[0] for p in parts]).to(device=device, dtype=torch.uint8).contiguous()
        scales = torch.cat([p[1] for p in parts]).to(device=device, dtype=torch.float16).contiguous()
        zeros = None
        if parts[0][2] is not None:   # one QuantConfig for all parts: all have zeros or none has
            zeros = torch.cat([cast(torch.Tensor, p[2]) for p in parts]).to(device=device,
                                                                             dtype=torch.float16).contiguous()
        assert group is not None   # parts is non-empty here (torch.cat above raises on an empty list)
        mins = None
        if qc.offset == "min":
            zeros, mins = None, zeros
        return W4A16Linear(qweight, scales, zeros, group, torch.cat(bs) if bs else None, compute_dtype=dtype,
                           mins=mins)

    return make_linear



def q8_embedding(tensors: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype,
                 device: torch.device, source: str = "") -> Q8Embedding:
    """`model.embed_tokens.qweight` int8 [V, H] + `.scales` fp16 [V, H/32] (a GGUF Q8_0 embedding, native import)."""
    q, s = tensors["model.embed_tokens.qweight"], tensors.get("model.embed_tokens.scales")
    want_s = (shape[0], shape[1] // 32)
    if q.dtype != torch.int8 or tuple(q.shape) != shape or s is None or tuple(s.shape) != want_s:
        raise CheckpointError(f"{source}: model.embed_tokens.qweight {q.dtype} {tuple(q.shape)} and .scales "
                              f"{None if s is None else tuple(s.shape)}: expected int8 {shape} and {want_s}")
    return Q8Embedding(q.to(device), s.to(device=device, dtype=torch.float16), dtype)
