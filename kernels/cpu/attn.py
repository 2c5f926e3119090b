"""CPU ops for the decode step between the GEMMs (C++, AVX2/FMA/F16C: kernels/cpu/attn.cpp), built on first use
as their own extension `edgeinfer_cpu_attn` (the same capability check and EDGEINFER_CPU_KERNELS mode as the
INT4 kernels in kernels.cpu: auto | ext | torch).

  decode_attention(q [B, H, D] fp32, k_cache, v_cache [P, S, KVH, D] fp32|bf16|fp16|fp8|int8, block_tables [B, W] int32,
                   context_lens [B] int32, sm_scale, k_scale=None, v_scale=None) -> [B, H, D]
  mla_decode_attention(q [B, H, D] fp32 (absorbed: [W_UK^T q_nope, q_pe]), cache [P, S, 1, D] latent rows (same
                   dtypes), block_tables, context_lens, sm_scale, v_dim, scale=None) -> [B, H, v_dim]
                 (MLA: the latent row is every head's key, its first v_dim values the value)
  mla_prefill_attention(q [T, H, D] fp32 (absorbed), cache [P, S, 1, D], block_tables, cu_seqlens_q, context_lens,
                        sm_scale, v_dim, scale=None) -> [T, H, v_dim]   (MLA's latent-form prefill, causal)
  prefill_attention(q [T, H, D] fp32, k_cache, v_cache, block_tables [B, W] int32, cu_seqlens_q [B + 1] int32,
                    context_lens [B] int32, sm_scale, k_scale=None, v_scale=None) -> [T, H, D]
                 (causal; each score and output element one FMA chain of its own: row-invariant)
  rope_kv_store_(qkv [T, (H + 2 KVH) D] fp32, positions [T] int64, cos, sin [max_pos, D], k_cache, v_cache (or
                 None: rope only), slot_mapping [T] int64, num_heads, num_kv_heads, k_scale=None, v_scale=None)
                 -> None   (in place; fp8/int8 caches quantized with a scale per (token, kv head), as kernels.kv_store)
  rope_norm_kv_store_(qkv [T, (H + 2 KVH) Dh], positions, cos, sin [max_pos, D <= Dh], k_cache, v_cache,
                      slot_mapping, num_heads, num_kv_heads, head_dim, q_norm [Dh] | None, k_norm, eps,
                      k_scale=None, v_scale=None) -> None
                 (QK-norm per head, then rope on the first D of each head: Qwen3, GLM-4.5)
  rms_norm(x [T, N], weight [N], eps) -> [T, N]
  add_rms_norm_(x, residual, weight, eps) -> None      (residual += x; x = rms_norm(residual) * weight)
  silu_mul(gate_up [T, 2I]) -> [T, I]                  (silu(gate) * up)

Every op has a pure-torch reference with the same signature in kernels.cpu.attn_reference; `ops()` returns
the extension's ops where enabled() and the references otherwise.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import edgeinfer.kernels.cpu as cpu
from edgeinfer.kernels.cpu import attn_reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attn.cpp")
NAME = "edgeinfer_cpu_attn"


@functools.cache
def _ext() -> Any:
    reason = cpu.unavailable_reason()
    if reason is not None:
        raise cpu.KernelUnavailable(f"edgeinfer CPU attention ops unavailable: {reason}")
    cpu.build_extension(NAME, SOURCE)
    return getattr(torch.ops, NAME)


@functools.cache
def _auto_available() -> bool:
    try:
        _ext()
    except (cpu.KernelUnavailable, RuntimeError, OSError) as e:
        log.warning("%s; the decode step runs on torch ops instead (slower). %s=torch silences this.",
                    e, cpu.MODE_ENV)
        return False
    return True


def enabled() -> bool:
    """Same rule as kernels.cpu.enabled(): torch -> never; ext -> required (raises); auto -> where it builds."""
    m = cpu.mode()
    if m == "torch":
        return False
    if m == "ext":
        _ext()
        return True
    return _auto_available()


def ops() -> Any:
    """The C++ ops where enabled(), else the pure-torch references (same names and signatures)."""
    return _ext() if enabled() else reference_ops()


def reference_ops() -> ModuleType:
    return attn_reference
