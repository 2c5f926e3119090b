"""Pure-torch references of kernels.cpu.attn's ops, same signatures (the fallback where the extension is
unavailable, and the oracle of tests/kernels/cpu/test_attn.py). They are the model's own torch path:
kernels.paged_decode_attention_reference, x * cos + rotate_half(x) * sin, kernels.kv_store, F.rms_norm, silu."""

from __future__ import annotations

import math

import torch

from edgeinfer.kernels.kv_store import kv_store_reference
from edgeinfer.kernels.moe_route import route_topk
from edgeinfer.kernels.paged_decode_attention import paged_decode_attention_reference
from edgeinfer.kernels.paged_mla_attention import paged_mla_decode_attention_reference
from edgeinfer.kernels.paged_prefill_attention import paged_prefill_attention_reference


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, sm_scale, k_scale=None, v_scale=None):
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, sm_scale,
                                            k_scale, v_scale)


def mla_decode_attention(q, cache, block_tables, context_lens, sm_scale, v_dim, scale=None):
    return paged_mla_decode_attention_reference(q, cache, block_tables, context_lens, sm_scale, v_dim, scale)


def mla_prefill_attention(q, cache, block_tables, cu_seqlens_q, context_lens, sm_scale, v_dim, scale=None):
    # the latent pool as both K and V: each output column is its own p @ V column, so the first v_dim columns are
    # the attention over the values' latent part
    return paged_prefill_attention_reference(q, cache, cache, block_tables, cu_seqlens_q, context_lens, sm_scale,
                                             scale, scale)[..., :v_dim].contiguous()


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sm_scale, k_scale=None,
                      v_scale=None):
    return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sm_scale,
                                             k_scale, v_scale)


def hadamard_heads_(x: torch.Tensor) -> None:
    """x [..., n] <- x H / sqrt(n), H the Sylvester-Hadamard matrix (n a power of two), in place: butterflies of
    spans 1, 2, 4, ... then the scale (attn.cpp's hadamard_: the same fp32 operations, the same bits). H / sqrt(n)
    is orthonormal and symmetric, so (q H) . (k H) = q . k: rotating q and k alike leaves attention unchanged while
    spreading k's outlier channels over the head before fp8 rounds it (docs/QUANTIZATION.md)."""
    n = x.shape[-1]
    if n < 2 or n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two head_dim, got {n}")
    h = 1
    while h < n:
        y = x.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :].clone(), y[..., 1, :].clone()
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        h *= 2
    x.mul_(1.0 / math.sqrt(n))


def rope_kv_store_(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, k_scale=None,
                   v_scale=None, hadamard=False) -> None:
    # whole heads, no QK-norm: the plain case of rope_norm_kv_store_ (as in attn.cpp)
    rope_norm_kv_store_(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                        cos.shape[1], None, None, 0.0, k_scale, v_scale, hadamard)


def rope_norm_kv_store_(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                        q_norm, k_norm, eps, k_scale=None, v_scale=None, hadamard=False) -> None:
    t, d = qkv.shape[0], cos.shape[1]
    nh = num_heads + num_kv_heads
    x = qkv[:, : nh * head_dim].view(t, nh, head_dim)
    if q_norm is not None:
        x[:, :num_heads] = torch.nn.functional.rms_norm(x[:, :num_heads], q_norm.shape, q_norm, eps)
        x[:, num_heads:] = torch.nn.functional.rms_norm(x[:, num_heads:], k_norm.shape, k_norm, eps)
    rot = x[..., :d]
    c, s = cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]
    rot.copy_(rot * c + rot.roll(d // 2, -1) * s)
    if hadamard:
        hadamard_heads_(x)
    if k_cache is not None:
        k = qkv[:, num_heads * head_dim: nh * head_dim].view(t, num_kv_heads, head_dim)
        v = qkv[:, nh * head_dim:].view(t, num_kv_heads, head_dim)
        kv_store_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rms_norm(x, weight, eps):
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm_(x, residual, weight, eps) -> None:
    residual.add_(x)
    x.copy_(torch.nn.functional.rms_norm(residual, weight.shape, weight, eps))


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def decode_layers(x, h, positions, cos, sin, slots, tables, lens, weights, kv, scales, extras, ints, floats, residual,
                  tau):
    """The decode plan's layer loop (kernels/cpu/attn.cpp decode_layers' layout: per layer 6 weights, 7 extras, 16
    ints, 5 floats), on these references and kernels.cpu.reference's GEMMs; MoE layers route by
    kernels.moe_route.route_topk, as the model does."""
    from edgeinfer.kernels.cpu import reference as gemms

    def gemm(a, w, n):
        return gemms.q4_1x8_gemm_residual(a, w, n, tau) if residual else gemms.q4_1x8_gemm(a, w, n)

    t = x.shape[0]
    for layer in range(len(kv) // 2):
        qkv_w, o_w, gu_w, down_w, post_w, nxt_w = weights[6 * layer: 6 * layer + 6]
        bias, q_norm, k_norm, router, corr, moe_gu, moe_dn = extras[7 * layer: 7 * layer + 7]
        (qkv_n, o_n, gu_n, down_n, nh, nkv, hd, hadamard, rotary, moe, top_k, sigmoid, n_group, topk_group, norm_topk,
         inter) = ints[16 * layer: 16 * layer + 16]
        post_eps, nxt_eps, scale, qk_eps, scaling = floats[5 * layer: 5 * layer + 5]
        k, v, ks, vs = kv[2 * layer], kv[2 * layer + 1], scales[2 * layer], scales[2 * layer + 1]
        qkv = gemm(h, qkv_w, qkv_n)
        if bias is not None:
            qkv = qkv + bias
        if rotary:
            rope_norm_kv_store_(qkv, positions, cos, sin, k, v, slots, nh, nkv, hd, q_norm, k_norm, qk_eps, ks, vs,
                                bool(hadamard))
        else:
            rope_kv_store_(qkv, positions, cos, sin, k, v, slots, nh, nkv, ks, vs, bool(hadamard))
        out = decode_attention(qkv[:, : nh * hd].view(t, nh, hd), k, v, tables, lens, scale, ks, vs)
        a = gemm(out.reshape(t, nh * hd).contiguous(), o_w, o_n)
        add_rms_norm_(a, x, post_w, post_eps)
        if not moe:
            h = gemm(silu_mul(gemm(a, gu_w, gu_n)), down_w, down_n)
        else:
            rw, ids = route_topk(a @ router.t(), top_k, bool(sigmoid), n_group, topk_group, bool(norm_topk), scaling,
                                 corr)
            h = gemms.q4_1x8_moe(a, ids, rw.contiguous(), moe_gu, moe_dn, inter, residual, tau)
            if gu_w is not None:
                gate, up = gemm(a, gu_w, gu_n).chunk(2, dim=-1)
                h = h + gemm(torch.nn.functional.silu(gate) * up, down_w, down_n)
        add_rms_norm_(h, x, nxt_w, nxt_eps)
    return h

