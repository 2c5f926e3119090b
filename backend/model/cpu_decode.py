"""The CPU decode plan of the served native model: decode-only steps through one lean layer loop (in C++ when
the native GEMMs and step ops are there: kernels/cpu/attn.cpp decode_layers), built by LlamaModel.prepack() (backend/model/decoder.py)
once the linears are packed (docs/KERNELS.md)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

import edgeinfer.backend.model.linear as linear_mod
import edgeinfer.kernels.cpu as cpu_kernels
import edgeinfer.kernels.cpu.attn as cpu_step_ops
from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV
from edgeinfer.backend.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from edgeinfer.backend.model.linear import W4A16Linear

_NATIVE = (cpu_kernels.q4_1x8_gemm, cpu_kernels.q4_1x8_gemm_residual)   # the GEMMs decode_layers calls
_CPP_LOOP = os.environ.get("EDGEINFER_CPU_DECODE_LOOP", "cpp") != "python"   # A/B switch (docs/KERNELS.md)


class DecodePlan:
    """_forward_cpu's layer loop for a decode-only step of the served native model, with the same ops in the same
    order (so the same bits) but without what a batch-1 step pays per layer in Python: four nn.Module calls, the
    linears' per-call layout checks and the ops' packet lookups. Measured at batch 1 on the served model (2
    threads, one process, 5 alternated pairs of 128-token generations): median 188.5 -> 234.2 tok/s (1.24x).
    Applies when every decoder linear is a bias-free Q4_1 x8 W4A16Linear with a fused gate_up (the GGUF
    default) and the rows are under linear.DENSE_MIN_ROWS (any KV dtype: the rope op quantizes fp8 pages as it
    stores them); otherwise the model runs _forward_cpu (docs/KERNELS.md)."""

    def __init__(self, model: Any, first: RMSNorm, layers: list[tuple], residual: bool, tau: float) -> None:
        self.model, self.layers = model, layers
        self.first_norm = (first.weight, first.eps)
        self.residual = residual   # the linears' activations in two int8 passes (W4A16Linear.residual_activations)
        self.tau = tau             # ... and which blocks get the second (W4A16Linear.second_pass_tau)
        # the flat per-layer lists of the C++ loop (kernels/cpu/attn.cpp decode_layers); kv: per kv_caches list
        self.weights = [w for r in layers for w in (r[1], r[3], r[5], r[7], r[9], r[11])]
        self.ints = [v for r in layers for v in (r[2], r[4], r[6], r[8], r[0].cfg.num_heads, r[0].cfg.num_kv_heads,
                                                 r[0].cfg.head_dim, 0)]
        self.floats = [float(v) for r in layers for v in (r[10], r[12], r[0].scale)]
        self._kv: tuple[int, list[torch.Tensor], list[torch.Tensor | None], list[int]] | None = None

    @classmethod
    def build(cls, model: Any) -> DecodePlan | None:
        layers: list[DecoderLayer] = list(model.layers)   # type: ignore[arg-type]
        norms = [layer.input_layernorm for layer in layers[1:]] + [model.norm]
        rows: list[tuple] = []
        modes: set[tuple[bool, float]] = set()   # (two passes?, second-pass tau) of every linear: one
        for layer, nxt in zip(layers, norms):
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, MLP) or not isinstance(attn, Attention) or attn.norms_or_partial_rope:
                return None
            linears = [m for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                       if isinstance(m, W4A16Linear) and m.q4_1x8 is not None and m.bias is None]
            if len(linears) != 4:
                return None
            modes.update((m.residual_activations, m.second_pass_tau) for m in linears)
            post = layer.post_attention_layernorm
            rows.append((attn, *(w for m in linears for w in (m.q4_1x8, m._shape[0])),
                         post.weight, post.eps, nxt.weight, nxt.eps))
        if not rows or len(modes) != 1:
            return None
        return cls(model, layers[0].input_layernorm, rows, *modes.pop())

    def applies(self, x: torch.Tensor, kv_caches: list[LayerKV]) -> bool:
        return x.shape[0] < linear_mod.DENSE_MIN_ROWS and x.dtype == torch.float32

    def _kv_lists(self, kv_caches: list[LayerKV]) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]]:
        if self._kv is None or self._kv[0] != id(kv_caches[0].k):   # the pool's tensors live as long as the model
            kv = [t for c in kv_caches for t in (c.k, c.v)]
            scales = [t for c in kv_caches for t in (c.k_scale, c.v_scale)]
            ints = list(self.ints)
            for i, c in enumerate(kv_caches):
                ints[8 * i + 7] = int(c.hadamard)
            self._kv = (id(kv_caches[0].k), kv, scales, ints)
        return self._kv[1], self._kv[2], self._kv[3]

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV], meta: AttentionMetadata,
            ops) -> torch.Tensor:
        if (_CPP_LOOP and ops is not cpu_step_ops.reference_ops() and hasattr(ops, "decode_layers")
                and (cpu_kernels.q4_1x8_gemm, cpu_kernels.q4_1x8_gemm_residual) == _NATIVE):
            kv, scales, ints = self._kv_lists(kv_caches)
            rotary = self.model.rotary
            return ops.decode_layers(x, ops.rms_norm(x, *self.first_norm), positions, rotary.cos, rotary.sin,
                                     meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                     self.weights, kv, scales, ints, self.floats, self.residual, self.tau)
        return self.run_python(x, positions, kv_caches, meta, ops)

    def run_python(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                   meta: AttentionMetadata, ops) -> torch.Tensor:
        """The loop decode_layers runs in C++: where the step ops are the pure-torch references (with the native
        GEMMs), or a test swapped a GEMM for its reference."""
        # looked up per step: tests swap in the reference
        gemm = (functools.partial(cpu_kernels.q4_1x8_gemm_residual, tau=self.tau) if self.residual
                else cpu_kernels.q4_1x8_gemm)
        rotary = self.model.rotary
        rope_kv_store_, decode_attention = ops.rope_kv_store_, ops.decode_attention
        add_rms_norm_, silu_mul = ops.add_rms_norm_, ops.silu_mul
        cos, sin, slots = rotary.cos, rotary.sin, meta.slot_mapping
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        t = x.shape[0]
        h = ops.rms_norm(x, *self.first_norm)
        for (attn, qkv_w, qkv_n, o_w, o_n, gu_w, gu_n, down_w, down_n, post_w, post_eps, nxt_w, nxt_eps), kv in zip(
                self.layers, kv_caches):
            c = attn.cfg
            qkv = gemm(h, qkv_w, qkv_n)
            rope_kv_store_(qkv, positions, cos, sin, kv.k, kv.v, slots, c.num_heads, c.num_kv_heads, kv.k_scale,
                           kv.v_scale, kv.hadamard)
            q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
            out = decode_attention(q, kv.k, kv.v, tables, lens, attn.scale, kv.k_scale, kv.v_scale)
            a = gemm(out.reshape(t, c.q_size).contiguous(), o_w, o_n)
            add_rms_norm_(a, x, post_w, post_eps)
            h = gemm(silu_mul(gemm(a, gu_w, gu_n)), down_w, down_n)
            add_rms_norm_(h, x, nxt_w, nxt_eps)
        return h


# ---------------------------------------------------------------- loading
