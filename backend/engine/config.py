"""Engine configuration (frozen; derived values as properties)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.kv_pool import KVFormat
from protocol.defaults import CACHE_SEED, PAGE_SIZE


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = PAGE_SIZE
    kv_cache_bytes: int = 1 << 30           # KV budget; ignored when num_pages is set
    num_pages: int | None = None
    kv_dtype: str = "auto"                  # auto | fp32 | bf16 | fp16 | fp8_e4m3
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512       # chunked-prefill token budget per step
    max_model_len: int | None = None
    cache_seed: bytes = CACHE_SEED.encode()
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size!r} is invalid: expected a power of two")
        if self.kv_dtype != "auto":
            KVFormat(self.kv_dtype)         # raises naming the bad value
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")

    def resolve_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return KVFormat.resolve(self.kv_dtype, model_dtype).dtype
