"""The KV pool: its format, one KVFormat value (dtype, latent or K/V, scale dtype and layout, bytes per token),
named as it travels (`KVFormat.ident`: `BackendInfo.kv_format`, page identity, the page header's `kv_dtype`); its
allocation (allocate_pool, called by model_runner.ModelRunner): per layer k, v `[num_pages, page_size, kv_heads,
head_dim]` and, for fp8/int8 only, k_scale, v_scale `[num_pages, page_size, kv_heads]` in SCALE_DTYPE; for an MLA model
(`latent`) one tensor per layer, k = the latent rows `[num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]`
(v None) and for fp8/int8 one scale per token row. Page bodies move in and out of the pool through the model's
PageIO (backend/model/batch.py; `ModelRunner.page_io`)."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from edgeinfer.backend.model.batch import LayerKV

if TYPE_CHECKING:
    from edgeinfer.backend.model.model_config import ModelConfig

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
             "int8": torch.int8}
SCALED = (torch.float8_e4m3fn, torch.int8)   # one scale per token-head (MLA: per token row) beside the values
SCALE_DTYPE = torch.bfloat16   # 2 bytes per token-head (float32 would make fp8/int8 only 1.88x of bf16)


@dataclass(frozen=True)
class KVFormat:
    name: str                  # a KV_DTYPES key
    latent: bool = False       # MLA: one latent row per token and layer, no separate V
    hadamard: bool = False     # fp8/int8 K/V: q and k heads rotated by H / sqrt(head_dim) before k is stored

    def __post_init__(self) -> None:
        if self.name not in KV_DTYPES:
            raise ValueError(f"kv_dtype={self.name!r} is invalid: expected auto or one of {', '.join(KV_DTYPES)}")

    @classmethod
    def resolve(cls, name: str, model_dtype: torch.dtype, latent: bool = False, head_dim: int = 0) -> KVFormat:
        """`auto`: the model's dtype (a node's `--kv-dtype auto` is resolved before the engine by the measured
        gate, backend/quant/kv_gate.py). fp8/int8 K/V pages of a power-of-two head_dim are Hadamard-rotated (K
        only: q and k alike, so attention is unchanged): measured on the default model it takes fp8's 4k
        perplexity over fp32 KV from 1.0094x to 1.0009x on one text (docs/QUANTIZATION.md)."""
        fmt = cls.of(model_dtype, latent) if name == "auto" else cls(name, latent)
        rotate = fmt.scaled and not latent and head_dim >= 2 and head_dim & (head_dim - 1) == 0
        return cls(fmt.name, latent, hadamard=True) if rotate else fmt

    @classmethod
    def of(cls, dtype: torch.dtype, latent: bool = False) -> KVFormat:
        return cls({v: k for k, v in KV_DTYPES.items()}[dtype], latent)

    @property
    def ident(self) -> str:
        """The format's name where pages are identified and checked (page keys, headers, BackendInfo): a latent
        page and a K/V page of the same dtype never share a key or pass each other's header check."""
        if self.latent:
            return f"mla_{self.name}"
        return f"{self.name}_hadamard" if self.hadamard else self.name

    @property
    def dtype(self) -> torch.dtype:
        return KV_DTYPES[self.name]

    @property
    def scaled(self) -> bool:
        """fp8/int8: one scale per token-head beside the values."""
        return self.dtype in SCALED

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return SCALE_DTYPE if self.scaled else None

    @property
    def scale_layout(self) -> str:
        """As the page header (cache_store.codec.PageFormat) names it."""
        if not self.scaled:
            return "none"
        return "per_token_latent_bf16" if self.latent else "per_token_kv_head_bf16"

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        scale = SCALE_DTYPE.itemsize if self.scaled else 0
        return (1 if self.latent else 2) * num_layers * num_kv_heads * (head_dim * self.dtype.itemsize + scale)


def kv_bytes_per_token(model, kv_dtype: torch.dtype) -> int:
    c = model.cfg
    return KVFormat.of(kv_dtype, c.mla is not None).bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, except that on CPU the memory is an anonymous mapping: the kernel hands out zeroed pages on
    first write, so a KV pool costs resident memory only for the pages requests have used (torch.zeros writes
    every byte at once: the whole budget resident from start-up)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    elt = torch.empty((), dtype=dtype).element_size()
    nbytes = elt * int(np.prod(shape))
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)   # the tensor keeps buf alive


def allocate_pool(fmt: KVFormat, num_pages: int, page_size: int, model_cfg: ModelConfig,
                  device: torch.device | str) -> list[LayerKV]:
    """One LayerKV per layer: lazily zeroed values, and for a scaled format scales of one."""
    shape = (num_pages, page_size, model_cfg.num_kv_heads, model_cfg.head_dim)

    def scales() -> torch.Tensor | None:
        return torch.ones(shape[:3], dtype=fmt.scale_dtype, device=device) if fmt.scaled else None

    if fmt.latent:
        return [LayerKV(lazy_zeros(shape, fmt.dtype, device), None, scales(), None)  # type: ignore[arg-type]
                for _ in range(model_cfg.num_layers)]
    return [LayerKV(lazy_zeros(shape, fmt.dtype, device), lazy_zeros(shape, fmt.dtype, device), scales(), scales(),
                    hadamard=fmt.hadamard) for _ in range(model_cfg.num_layers)]
