"""Pick the Triton kernel or the torch reference for each op.

CUDA tensors run Triton; everything else runs the reference. EDGEINFER_KERNELS overrides:
  auto (default) | reference (references everywhere) | triton (Triton everywhere; on CPU
  only under TRITON_INTERPRET=1, which is how the tests drive the kernels).
Triton itself is imported by the kernel files only where it can run (see kernels/_triton.py).
"""

from __future__ import annotations

import os
import warnings

import torch

from edgeinfer.kernels import _triton
from edgeinfer.kernels import fused_moe as _moe
from edgeinfer.kernels import kv_store as _kv
from edgeinfer.kernels import page_checksum as _sum
from edgeinfer.kernels import paged_decode_attention as _decode
from edgeinfer.kernels import paged_mla_attention as _mla
from edgeinfer.kernels import paged_prefill_attention as _prefill
from edgeinfer.kernels import w4a16_gemm as _gemm

MODES = ("auto", "reference", "triton")


def kernel_mode() -> str:
    mode = os.environ.get("EDGEINFER_KERNELS", "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"EDGEINFER_KERNELS={mode!r}; expected one of: {', '.join(MODES)}")
    return mode


_warned = False


def use_triton(t: torch.Tensor) -> bool:
    global _warned
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        return True
    if not t.is_cuda:
        return False
    if not _triton.HAS_TRITON:
        if not _warned:
            warnings.warn(f"CUDA tensors but Triton is unavailable ({_triton.IMPORT_ERROR}): using torch references",
                          stacklevel=3)
            _warned = True
        return False
    return True


def kv_store(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    # key, value: [T, kv_heads, head_dim]; slot_mapping: [T] int64, -1 = skip
    fn = _kv.kv_store_triton if use_triton(key) else _kv.kv_store_reference
    fn(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, sm_scale,
                           k_scale=None, v_scale=None, out=None):
    # q: [B, heads, head_dim] -> [B, heads, head_dim]
    fn = _decode.paged_decode_attention_triton if use_triton(q) else _decode.paged_decode_attention_reference
    return fn(q, k_cache, v_cache, block_tables, context_lens, sm_scale, k_scale, v_scale, out)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sm_scale,
                            k_scale=None, v_scale=None, out=None, max_seqlen_q=None):
    # q: [T, heads, head_dim] packed by cu_seqlens_q -> [T, heads, head_dim]; max_seqlen_q (host int, optional)
    # spares the Triton launcher a device sync to size its grid
    if use_triton(q):
        return _prefill.paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                       sm_scale, k_scale, v_scale, out, max_seqlen_q=max_seqlen_q)
    return _prefill.paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                      sm_scale, k_scale, v_scale, out)


def w4a16_gemm(x, qweight, scales, zeros=None, group_size=128, out=None):
    # x: [M, K] fp16/bf16, qweight: [N, K//2] uint8 -> [M, N]
    fn = _gemm.w4a16_gemm_triton if use_triton(x) else _gemm.w4a16_gemm_reference
    return fn(x, qweight, scales, zeros, group_size, out)


def fused_moe_w4a16(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group_size=128):
    # x: [T, H] fp16/bf16; weights, ids: [T, k]; w1: [E, 2I, H//2] (gate rows, then up), w2: [E, H, I//2] -> [T, H]
    fn = _moe.fused_moe_w4a16_triton if use_triton(x) else _moe.fused_moe_w4a16_reference
    return fn(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group_size)


fused_moe_w4a16_reference = _moe.fused_moe_w4a16_reference


def paged_mla_decode_attention(q, cache, block_tables, context_lens, sm_scale, v_dim, scale=None):
    # q: [B, H, kv_lora_rank + rope] (absorbed), cache: [P, S, 1, same] latent rows -> [B, H, v_dim]
    fn = _mla.paged_mla_decode_attention_triton if use_triton(q) else _mla.paged_mla_decode_attention_reference
    return fn(q, cache, block_tables, context_lens, sm_scale, v_dim, scale)


mla_latent_store = _mla.mla_latent_store


def page_checksum(buf):
    # buf: [n, page_bytes] uint8 (page_bytes % 4 == 0) -> [n] int64, on buf's device
    fn = _sum.page_checksum_triton if use_triton(buf) else _sum.page_checksum_reference
    return fn(buf)
