"""The backend's configuration: one frozen value built once from the command line (backend.server.parse_args)
and read by build_state and the page-store wiring."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from edgeinfer.backend.engine.config import EngineConfig


@dataclass(frozen=True)
class BackendConfig:
    model: str | None
    model_name: str | None
    host: str
    port: int
    node_id: str | None
    dtype: str
    device: str
    tensor_parallel: int      # ranks of this node (backend/parallel): 1 = one process
    expert_parallel: bool     # split the routed experts by rank instead of each expert's width
    page_size: int
    kv_dtype: str
    kv_cache_bytes: int
    num_pages: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    max_queue_wait_s: float   # 0: no bound
    keepalive_s: float   # 0: no keepalive lines
    no_prefix_cache: bool
    scheduler: str
    cache_eviction: str
    prefill_token_weight: float
    decode_token_weight: float
    priority_aging_steps: int
    no_fair_preemption: bool
    no_prefill_isolation: bool
    contended_step_tokens: int   # 0: no cap
    contended_step_ratio: float  # 0: the fixed token cap only
    contended_window_s: float
    no_cuda_graphs: bool
    no_kv_integrity: bool
    kv_verify_fraction: float
    fixed_threads: bool
    redis_url: str | None
    redis_cluster: bool
    store_tier: str   # redis | host | none
    host_store_bytes: int
    store_fetch_timeout: float
    redis_key_prefix: str
    cache_seed: str
    operator_key: str | None
    internal_secret_file: str | None
    insecure_no_internal_auth: bool
    internal_secret: str | None   # None only with --insecure-no-internal-auth
    page_key_file: str | None
    start_drained: bool
    version: str
    heartbeat: float
    log_level: str

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> BackendConfig:
        """The parsed flags, one field per dest: the parser owns the defaults, and a flag without a field (or a
        field without a flag) is a TypeError here, not a silent default."""
        return cls(**vars(ns))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(page_size=self.page_size, kv_cache_bytes=self.kv_cache_bytes, num_pages=self.num_pages,
                            kv_dtype=self.kv_dtype, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                            cache_seed=self.cache_seed.encode(), enable_prefix_cache=not self.no_prefix_cache,
                            scheduler=self.scheduler, cache_eviction=self.cache_eviction,
                            prefill_token_weight=self.prefill_token_weight,
                            decode_token_weight=self.decode_token_weight,
                            priority_aging_steps=self.priority_aging_steps,
                            fair_preemption=not self.no_fair_preemption,
                            prefill_isolation=not self.no_prefill_isolation,
                            contended_step_tokens=self.contended_step_tokens,
                            contended_step_ratio=self.contended_step_ratio,
                            contended_window_s=self.contended_window_s, cuda_graphs=not self.no_cuda_graphs,
                            adaptive_threads=not self.fixed_threads, kv_integrity=not self.no_kv_integrity,
                            kv_verify_fraction=self.kv_verify_fraction)
