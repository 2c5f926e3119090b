"""The CPU decode plan of a natively packed model: decode-only steps through one lean layer loop (in C++ when
the native GEMMs and step ops are there: kernels/cpu/attn.cpp decode_layers), built by DecoderModel.prepack() (backend/model/decoder.py)
once the linears are packed (docs/KERNELS.md)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

import edgeinfer.backend.model.linear as linear_mod
import edgeinfer.kernels.cpu as cpu_kernels
import edgeinfer.kernels.cpu.attn as cpu_step_ops
from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV
from edgeinfer.backend.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from edgeinfer.backend.model.linear import W4A16Linear
from edgeinfer.backend.model.moe import Int4Experts, SparseMoE, route

_NATIVE = (cpu_kernels.q4_1x8_gemm, cpu_kernels.q4_1x8_gemm_residual)   # the GEMMs decode_layers calls
_CPP_LOOP = os.environ.get("EDGEINFER_CPU_DECODE_LOOP", "cpp") != "python"   # A/B switch (docs/KERNELS.md)


def _x8(m: Any, bias_ok: bool = False) -> bool:
    return isinstance(m, W4A16Linear) and m.q4_1x8 is not None and (bias_ok or m.bias is None)


@dataclass
class LayerPlan:
    """One decoder layer as the loop runs it. The flat slots (weights, extras, ints, floats) are decode_layers'
    per-layer layout (kernels/cpu/attn.cpp: NW, NE, NI, NF)."""
    attn: Attention
    qkv: W4A16Linear
    o: W4A16Linear
    post: RMSNorm
    nxt: RMSNorm
    gate_up: W4A16Linear | None      # the dense MLP's, or a MoE layer's shared experts' (None: no shared experts)
    down: W4A16Linear | None
    moe: SparseMoE | None = None

    @property
    def experts(self) -> Int4Experts:
        assert self.moe is not None and isinstance(self.moe.experts, Int4Experts)
        return self.moe.experts

    def weights(self) -> list[torch.Tensor | None]:
        return [self.qkv.q4_1x8, self.o.q4_1x8, None if self.gate_up is None else self.gate_up.q4_1x8,
                None if self.down is None else self.down.q4_1x8, self.post.weight, self.nxt.weight]

    def extras(self) -> list[torch.Tensor | None]:
        a, m = self.attn, self.moe
        return [self.qkv.bias, None if a.q_norm is None else a.q_norm.weight,
                None if a.k_norm is None else a.k_norm.weight,
                None if m is None else m.router, None if m is None else m.correction_bias,
                None if m is None else self.experts.gu_x8, None if m is None else self.experts.dn_x8]

    def ints(self, hadamard: bool) -> list[int]:
        c, m = self.attn.cfg, self.moe
        dense = [0 if self.gate_up is None else self.gate_up._shape[0], 0 if self.down is None else self.down._shape[0]]
        moe = [0] * 7 if m is None else [1, m.moe.top_k, int(m.moe.scoring == "sigmoid"), m.moe.n_group,
                                         m.moe.topk_group, int(m.moe.norm_topk_prob), self.experts.intermediate]
        return [self.qkv._shape[0], self.o._shape[0], *dense, c.num_heads, c.num_kv_heads, c.head_dim, int(hadamard),
                c.rope_dim if self.attn.norms_or_partial_rope else 0, *moe]

    def floats(self) -> list[float]:
        c = self.attn.cfg
        scaling = 0.0 if self.moe is None else float(self.moe.moe.routed_scaling_factor)
        return [float(self.post.eps), float(self.nxt.eps), float(self.attn.scale), float(c.rms_norm_eps), scaling]

    def linears(self) -> list[Any]:
        out: list[Any] = [m for m in (self.qkv, self.o, self.gate_up, self.down) if m is not None]
        return out + ([self.experts] if self.moe is not None else [])

    @classmethod
    def of(cls, layer: DecoderLayer, nxt: RMSNorm) -> LayerPlan | None:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or not _x8(attn.qkv_proj, bias_ok=True) or not _x8(attn.o_proj):
            return None
        moe, gate_up, down = None, None, None
        if isinstance(mlp, MLP):
            gate_up, down = mlp.gate_up_proj, mlp.down_proj
        elif (isinstance(mlp, SparseMoE) and mlp.expert_range is None and isinstance(mlp.experts, Int4Experts)
              and mlp.experts.prepacked):
            moe = mlp
            shared = mlp.shared_experts
            if shared is not None:
                if not isinstance(shared, MLP):
                    return None
                gate_up, down = shared.gate_up_proj, shared.down_proj
        else:
            return None
        if (gate_up is None) != (down is None) or (gate_up is not None and not (_x8(gate_up) and _x8(down))):
            return None
        if moe is None and gate_up is None:
            return None
        return cls(attn, attn.qkv_proj, attn.o_proj, layer.post_attention_layernorm, nxt,  # type: ignore[arg-type]
                   gate_up, down, moe)  # type: ignore[arg-type]


class DecodePlan:
    """_forward_cpu's layer loop for a decode-only step of a natively packed model, with the same ops in the same
    order (so the same bits) but without what a batch-1 step pays per layer in Python: four nn.Module calls, the
    linears' per-call layout checks and the ops' packet lookups. Measured at batch 1 on the served model (2
    threads, one process, 5 alternated pairs of 128-token generations): median 188.5 -> 234.2 tok/s (1.24x).
    Applies when every decoder linear is a Q4_1 x8 W4A16Linear (a bias on qkv allowed) with a fused gate_up (the
    GGUF default), every MLP dense or a Mixture-of-Experts layer whose experts are prepacked Int4Experts (all on
    this rank) and whose shared experts, if any, are such an MLP, attention of any rope / QK-norm form but not MLA,
    and the rows are under linear.DENSE_MIN_ROWS (any KV dtype: the rope op quantizes fp8/int8 pages as it stores
    them); otherwise the model runs _forward_cpu (docs/KERNELS.md)."""

    def __init__(self, model: Any, first: RMSNorm, layers: list[LayerPlan], residual: bool, tau: float) -> None:
        self.model, self.layers = model, layers
        self.first_norm = (first.weight, first.eps)
        self.residual = residual   # the linears' activations in two int8 passes (W4A16Linear.residual_activations)
        self.tau = tau             # ... and which blocks get the second (W4A16Linear.second_pass_tau)
        # the flat per-layer lists of the C++ loop (kernels/cpu/attn.cpp decode_layers); kv: per kv_caches list
        self.weights = [w for r in layers for w in r.weights()]
        self.extras = [t for r in layers for t in r.extras()]
        self.floats = [v for r in layers for v in r.floats()]
        self._kv: tuple[int, list[torch.Tensor], list[torch.Tensor | None], list[int]] | None = None

    @classmethod
    def build(cls, model: Any) -> DecodePlan | None:
        layers: list[DecoderLayer] = list(model.layers)   # type: ignore[arg-type]
        norms = [layer.input_layernorm for layer in layers[1:]] + [model.norm]
        rows: list[LayerPlan] = []
        for layer, nxt in zip(layers, norms):
            row = LayerPlan.of(layer, nxt)
            if row is None:
                return None
            rows.append(row)
        # (two passes?, second-pass tau) of every linear and expert slab: one mode for the whole loop
        modes = {(m.residual_activations, m.second_pass_tau) for r in rows for m in r.linears()}
        if not rows or len(modes) != 1:
            return None
        return cls(model, layers[0].input_layernorm, rows, *modes.pop())

    def applies(self, x: torch.Tensor, kv_caches: list[LayerKV]) -> bool:
        return x.shape[0] < linear_mod.DENSE_MIN_ROWS and x.dtype == torch.float32

    def _kv_lists(self, kv_caches: list[LayerKV]) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]]:
        if self._kv is None or self._kv[0] != id(kv_caches[0].k):   # the pool's tensors live as long as the model
            kv = [t for c in kv_caches for t in (c.k, c.v)]
            scales = [t for c in kv_caches for t in (c.k_scale, c.v_scale)]
            ints = [v for r, c in zip(self.layers, kv_caches) for v in r.ints(c.hadamard)]
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
                                     self.weights, kv, scales, self.extras, ints, self.floats, self.residual,
                                     self.tau)
        return self.run_python(x, positions, kv_caches, meta, ops)

    def run_python(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                   meta: AttentionMetadata, ops) -> torch.Tensor:
        """The loop decode_layers runs in C++: where the step ops are the pure-torch references (with the native
        GEMMs), or a test swapped a GEMM for its reference."""
        # looked up per step: tests swap in the reference
        q4 = (functools.partial(cpu_kernels.q4_1x8_gemm_residual, tau=self.tau) if self.residual
              else cpu_kernels.q4_1x8_gemm)

        def gemm(a: torch.Tensor, m: W4A16Linear | None) -> torch.Tensor:
            assert m is not None and m.q4_1x8 is not None
            return q4(a, m.q4_1x8, m._shape[0])
        rotary = self.model.rotary
        cos, sin, slots = rotary.cos, rotary.sin, meta.slot_mapping
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        t = x.shape[0]
        h = ops.rms_norm(x, *self.first_norm)
        for r, kv in zip(self.layers, kv_caches):
            attn, c = r.attn, r.attn.cfg
            qkv = gemm(h, r.qkv)
            if r.qkv.bias is not None:
                qkv = qkv + r.qkv.bias
            if attn.norms_or_partial_rope:
                qn, kn = attn.q_norm, attn.k_norm
                ops.rope_norm_kv_store_(qkv, positions, cos, sin, kv.k, kv.v, slots, c.num_heads, c.num_kv_heads,
                                        c.head_dim, None if qn is None else qn.weight,
                                        None if kn is None else kn.weight, c.rms_norm_eps, kv.k_scale, kv.v_scale,
                                        kv.hadamard)
            else:
                ops.rope_kv_store_(qkv, positions, cos, sin, kv.k, kv.v, slots, c.num_heads, c.num_kv_heads,
                                   kv.k_scale, kv.v_scale, kv.hadamard)
            q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
            out = ops.decode_attention(q, kv.k, kv.v, tables, lens, attn.scale, kv.k_scale, kv.v_scale)
            a = gemm(out.reshape(t, c.q_size).contiguous(), r.o)
            ops.add_rms_norm_(a, x, r.post.weight, r.post.eps)
            if r.moe is None:
                h = gemm(ops.silu_mul(gemm(a, r.gate_up)), r.down)
            else:
                m, ex = r.moe, r.experts
                assert ex.gu_x8 is not None and ex.dn_x8 is not None
                weights, ids = route(a @ m.router.t(), m.moe, m.correction_bias)
                h = cpu_kernels.q4_1x8_moe(a, ids, weights.contiguous(), ex.gu_x8, ex.dn_x8, ex.intermediate,
                                           self.residual, self.tau)
                if r.gate_up is not None:
                    gate, up = gemm(a, r.gate_up).chunk(2, dim=-1)
                    h = h + gemm(torch.nn.functional.silu(gate) * up, r.down)
            ops.add_rms_norm_(h, x, r.nxt.weight, r.nxt.eps)
        return h
