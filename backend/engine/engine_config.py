"""Engine configuration (frozen; derived values as properties)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeinfer.backend.engine.kv_pool import KVFormat
from edgeinfer.backend.engine.spec.policy import SpecPolicy
from edgeinfer.protocol.defaults import CACHE_SEED, PAGE_SIZE


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = PAGE_SIZE
    kv_cache_bytes: int = 512 << 20         # KV budget (resident as pages are first used); ignored when num_pages is set
    num_pages: int | None = None
    kv_dtype: str = "auto"                  # auto (the model dtype) | fp32 | bf16 | fp16 | fp8_e4m3 | int8
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512       # chunked-prefill token budget per step
    max_model_len: int | None = None
    cache_seed: bytes = CACHE_SEED.encode()
    enable_prefix_cache: bool = True
    scheduler: str = "fair"                 # fair (per-tenant VTC, backend.engine.fair) | fifo
    prefill_token_weight: float = 1.0       # VTC cost of a prefill token
    decode_token_weight: float = 2.0        # VTC cost of a decode token (the paper's w_q = 2 w_p)
    priority_aging_steps: int = 256         # a waiting request's priority class improves by 1 per this many steps
    fair_preemption: bool = True            # fair: preempt a tenant over its slot share to admit one under it
    max_fair_preemptions: int = 1           # fair: a request is preempted for fairness at most this many times
    prefill_isolation: bool = True          # fair: no over-share prefill in a step with an under-share first token
    contended_step_tokens: int = 32         # fair: prefill tokens per step while > 1 tenant is active (0: no cap);
                                            # with contended_step_ratio, only until the step cost is measured
    contended_step_ratio: float = 1.0       # fair: contended prefill time <= this x the step's other time (0: off)
    contended_window_s: float = 1.0         # fair: a tenant is active this long after its last request left
    cache_eviction: str = "fair"            # fair: evict cached pages of the tenant most over its share first | lru
    cuda_graphs: bool = True                # decode steps replay CUDA graphs (CUDA + Triton only; cuda_graphs.py)
    adaptive_threads: bool = True           # CPU: step threads = the cores other processes leave free (threads.py)
    kv_integrity: bool = True               # page identity checked before each step, at prefix hits, store receives
                                            # and frees; sealed pages checksummed (backend/engine/kv_integrity.py)
    kv_verify_fraction: float = 1.0         # of the sealed pages a prefix hit takes, the fraction whose checksum is
                                            # verified (0: none; needs kv_integrity)
    speculative: str = "ngram"              # ngram (prompt lookup drafts, adaptive) | off (backend/engine/spec/)
    spec_tokens: int = 4                    # the most draft tokens of a sequence per verify step
    spec_max_batch: int = 64                # no drafts in a step with more decoding sequences than this
    spec_adaptive: bool = True              # draft tokens only where they raise tokens/s (speculative.plan)
    grammar_fast_forward: bool = True       # tokens a grammar forces are emitted without a model step each
    grammar_mask_budget_s: float = 0.02     # one request's grammar work per token (mask, forced-token scan); over
                                            # it at compile or twice running, the request fails with a 400 (0: none)

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size!r} is invalid: expected a power of two")
        if self.kv_dtype != "auto":
            KVFormat(self.kv_dtype)         # raises naming the bad value
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.scheduler not in ("fair", "fifo"):
            raise ValueError(f"scheduler={self.scheduler!r} is invalid: expected fair or fifo")
        if self.cache_eviction not in ("fair", "lru"):
            raise ValueError(f"cache_eviction={self.cache_eviction!r} is invalid: expected fair or lru")
        for name in ("prefill_token_weight", "decode_token_weight"):
            v = getattr(self, name)
            if not v > 0 or v == float("inf"):
                raise ValueError(f"{name}={v!r} is invalid: expected a finite number > 0")
        if self.max_fair_preemptions < 0:
            raise ValueError(f"max_fair_preemptions={self.max_fair_preemptions!r} is invalid: expected >= 0")
        if self.contended_step_tokens < 0:
            raise ValueError(f"contended_step_tokens={self.contended_step_tokens!r} is invalid: expected >= 0")
        if not 0 <= self.contended_step_ratio < float("inf"):
            raise ValueError(f"contended_step_ratio={self.contended_step_ratio!r} is invalid: expected a finite number >= 0")
        if not 0 <= self.contended_window_s < float("inf"):
            raise ValueError(f"contended_window_s={self.contended_window_s!r} is invalid: expected a finite number >= 0")
        if not 0.0 <= self.kv_verify_fraction <= 1.0:
            raise ValueError(f"kv_verify_fraction={self.kv_verify_fraction!r} is invalid: expected 0 <= fraction <= 1")
        self.spec_policy()                  # raises naming a bad speculative setting
        if self.priority_aging_steps < 1:
            raise ValueError(f"priority_aging_steps={self.priority_aging_steps!r} is invalid: expected >= 1")

    def spec_policy(self) -> SpecPolicy:
        return SpecPolicy(self.speculative, self.spec_tokens, self.spec_max_batch, self.spec_adaptive)

    def resolve_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return KVFormat.resolve(self.kv_dtype, model_dtype).dtype
