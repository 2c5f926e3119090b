"""Llama-family decoder over a paged KV cache: the dense Llama, Mistral and Qwen2, and the Mixture-of-Experts
Qwen3-MoE and GLM-4.5/4.6 (GQA attention with per-head QK-norm and partial rotary where the config asks; the MLP
of a sparse layer is backend/model/moe.py's SparseMoE).

Attention reads K/V through block tables (kernels.paged_*_attention); the model
never holds a dense per-request KV tensor. One forward runs a flat batch of
tokens: the decode tokens of B_d sequences first, then the prefill chunks.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

import edgeinfer.backend.model.linear as linear_mod
import edgeinfer.kernels.cpu as cpu_kernels
import edgeinfer.kernels.cpu.attn as cpu_step_ops
from edgeinfer import kernels
from edgeinfer.backend.model.config import CheckpointError, ModelConfig, rope_inv_freq
from edgeinfer.backend.model.linear import (
    DenseLinear,
    Q8Embedding,
    Q8Linear,
    W4A16Linear,
    cpu_prepack_enabled,
)
from edgeinfer.backend.model.mla import MLAAttention, interleave_to_halves
from edgeinfer.backend.model.moe import DenseExperts, Int4Experts, SparseMoE
from edgeinfer.kernels.cpu.attn_reference import hadamard_heads_

_NATIVE = (cpu_kernels.q4_1x8_gemm, cpu_kernels.q4_1x8_gemm_residual)   # the GEMMs decode_layers calls
_CPP_LOOP = os.environ.get("EDGEINFER_CPU_DECODE_LOOP", "cpp") != "python"   # A/B switch (docs/KERNELS.md)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] int64
    num_decode: int                        # first num_decode tokens: one per decoding sequence
    decode_block_tables: torch.Tensor      # [B_d, max_pages] int32
    decode_context_lens: torch.Tensor      # [B_d] int32
    prefill_block_tables: torch.Tensor     # [B_p, max_pages] int32
    prefill_cu_seqlens_q: torch.Tensor     # [B_p + 1] int32
    prefill_context_lens: torch.Tensor     # [B_p] int32
    prefill_max_seqlen_q: int | None = None   # longest prefill chunk, from the host (None: the kernel syncs to find it)


@dataclass
class LayerKV:
    k: torch.Tensor                        # [num_pages, page_size, kv_heads, head_dim]; MLA: the latent rows
    v: torch.Tensor                        # MLA: None (its values are the latent's first kv_lora_rank columns)
    k_scale: torch.Tensor | None = None    # [num_pages, page_size, kv_heads] (fp8 only)
    v_scale: torch.Tensor | None = None
    hadamard: bool = False                 # q and k heads rotated before k is stored (kv_pool.KVFormat.hadamard)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm: the same fp32 math as x * rsqrt(mean(x^2) + eps) * w (bit-identical), in fewer ops
        if x.dtype == torch.float32:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return nn.functional.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class Rotary(nn.Module):
    cos: torch.Tensor   # buffers (register_buffer in __init__): [max_pos, head_dim]
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        inv_freq, mscale = rope_inv_freq(cfg)
        inv = torch.tensor(inv_freq, dtype=torch.float64)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv)
        cos, sin = (freqs.cos() * mscale).float(), (freqs.sin() * mscale).float()
        # HF "rotate_half" layout: x * [cos, cos] + [x2, x1] * [-sin, sin]
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(device), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1).to(device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # once per forward: [T, 1, head_dim] each
        return self.cos.index_select(0, positions)[:, None, :], self.sin.index_select(0, positions)[:, None, :]

    @staticmethod
    def rotate(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim] (q and k heads side by side: one pass rotates both)
        cos, sin = cos_sin
        xf = x.float()
        out = xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv: nn.Module, o: nn.Module, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj, self.o_proj = qkv, o
        self.q_norm, self.k_norm = q_norm, k_norm
        self.scale = cfg.head_dim ** -0.5
        # per-head QK-norm or rope on part of each head: torch ops here, kernels.cpu's rope_norm_kv_store_ on the CPU
        # path (its rope_kv_store_ rotates whole, un-normed heads)
        self.norms_or_partial_rope = q_norm is not None or cfg.rope_dim != cfg.head_dim

    def _rotated_qkv(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rotary: Rotary
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # qkv: [T, q_size + 2 kv_size] -> q [T, heads, head_dim], k, v [T, kv_heads, head_dim] (k, v contiguous)
        c = self.cfg
        t = qkv.shape[0]
        qk = qkv[:, : c.q_size + c.kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].reshape(t, c.num_kv_heads, c.head_dim).contiguous()
        if not self.norms_or_partial_rope:
            qk = rotary.rotate(cos_sin, qk)
            return qk[:, : c.num_heads], qk[:, c.num_heads:].contiguous(), v
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : c.num_heads]), self.k_norm(qk[:, c.num_heads:])), 1)
        rd = c.rope_dim
        if rd != c.head_dim:
            qk = torch.cat((rotary.rotate(cos_sin, qk[..., :rd]), qk[..., rd:]), -1)
        else:
            qk = rotary.rotate(cos_sin, qk)
        return qk[:, : c.num_heads], qk[:, c.num_heads:].contiguous(), v

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rotary: Rotary, kv: LayerKV,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._rotated_qkv(self.qkv_proj(x), cos_sin, rotary)
        if kv.hadamard:
            q = q.contiguous()
            hadamard_heads_(q)
            hadamard_heads_(k)
        kernels.kv_store(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale)
        nd = meta.num_decode
        dec = None
        if nd:
            dec = kernels.paged_decode_attention(q[:nd].contiguous(), kv.k, kv.v, meta.decode_block_tables,
                                                 meta.decode_context_lens, self.scale, kv.k_scale, kv.v_scale)
        return self._prefill_and_project(q, dec, kv, meta)

    def forward_cpu(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, kv: LayerKV,
                    meta: AttentionMetadata, ops) -> torch.Tensor:
        """fp32 on CPU through kernels.cpu.attn's ops: rope + KV store in one pass over the qkv rows (fp8 pages
        quantized there, a scale per token-head), decode and prefill attention reading the pool's pages (fp8
        converted in registers); prefill rows attend to K/V as stored, each row alone (row-invariant: a cached
        prefix and a cold prefill give the same bits, docs/QUANTIZATION.md)."""
        c = self.cfg
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.norms_or_partial_rope:   # QK-norm and/or partial rotary: the op's variant with both
            qn, kn = self.q_norm, self.k_norm
            ops.rope_norm_kv_store_(qkv, positions, rotary.cos, rotary.sin, kv.k, kv.v, meta.slot_mapping,
                                    c.num_heads, c.num_kv_heads, c.head_dim, None if qn is None else qn.weight,
                                    None if kn is None else kn.weight, c.rms_norm_eps, kv.k_scale, kv.v_scale,
                                    kv.hadamard)
        else:
            ops.rope_kv_store_(qkv, positions, rotary.cos, rotary.sin, kv.k, kv.v, meta.slot_mapping,
                               c.num_heads, c.num_kv_heads, kv.k_scale, kv.v_scale, kv.hadamard)
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        nd = meta.num_decode
        dec = None
        if nd:
            dec = ops.decode_attention(q[:nd], kv.k, kv.v, meta.decode_block_tables, meta.decode_context_lens,
                                       self.scale, kv.k_scale, kv.v_scale)
        return self._prefill_and_project(q, dec, kv, meta, ops)

    def _prefill_and_project(self, q: torch.Tensor, dec: torch.Tensor | None, kv: LayerKV,
                             meta: AttentionMetadata, ops=None) -> torch.Tensor:
        """o_proj of the attention output: dec (the first meta.num_decode rows, already attended) followed by
        the prefill rows of q attended here (the CPU ops' prefill_attention when `ops` is given)."""
        c = self.cfg
        t, nd = q.shape[0], meta.num_decode
        pre = None
        if t > nd and ops is not None:
            pre = ops.prefill_attention(q[nd:].contiguous(), kv.k, kv.v, meta.prefill_block_tables,
                                        meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale,
                                        kv.k_scale, kv.v_scale)
        elif t > nd:
            pre = kernels.paged_prefill_attention(q[nd:].contiguous(), kv.k, kv.v, meta.prefill_block_tables,
                                                  meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                                                  self.scale, kv.k_scale, kv.v_scale,
                                                  max_seqlen_q=meta.prefill_max_seqlen_q)
        out = torch.cat((dec, pre)) if dec is not None and pre is not None else dec if pre is None else pre
        assert out is not None, "an attention step has decode or prefill rows"
        return self.o_proj(out.reshape(t, c.q_size))


class MLP(nn.Module):
    """SwiGLU. gate/up either fused in one module (quantized layers) or two (dense: on CPU a fused
    [2*intermediate, hidden] GEMM measured ~15% slower than two at 32 rows)."""

    def __init__(self, gate_up: nn.Module | tuple[nn.Module, nn.Module], down: nn.Module) -> None:
        super().__init__()
        if isinstance(gate_up, tuple):
            self.gate_proj, self.up_proj = gate_up
            self.gate_up_proj = None
        else:
            self.gate_up_proj = gate_up
        self.down_proj = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)

    def forward_cpu(self, x: torch.Tensor, ops) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.forward(x)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    self_attn: Attention | MLAAttention
    mlp: MLP | SparseMoE
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, attn: Attention | MLAAttention, mlp: MLP | SparseMoE, in_norm: RMSNorm, post_norm: RMSNorm) -> None:
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = in_norm, post_norm

    def forward(self, x, cos_sin, rotary, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, rotary, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor | Q8Embedding, layers: list[DecoderLayer],
                 norm: RMSNorm, lm_head: torch.Tensor | None, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Parameter | Q8Embedding = \
            embed if isinstance(embed, Q8Embedding) else nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.tied_lm_head = lm_head is None
        # [vocab, hidden]; the only holder of an untied head, so prepacking it frees the plain copy; a tied
        # head shares the embedding's storage, which the lookup keeps (its packed copy: prepacked_copy_bytes).
        # A Q8_0 embedding is tied through its dequantized copy (exact), which the head alone holds.
        if lm_head is None:
            lm_head = embed.dequantize() if isinstance(embed, Q8Embedding) else embed
        self.lm_head_linear: DenseLinear | Q8Linear = DenseLinear(lm_head)
        self.rotary = Rotary(cfg, device)
        self.step_ops = None   # kernels.cpu.attn's ops (or their references) once prepack() picks the CPU path
        self.parallel = None   # backend.parallel.comm.Comm once backend.parallel.shard made this a rank's shard
        self.vocab_range = (0, cfg.vocab_size)   # the embedding / head rows this rank holds (vocab-parallel)
        self.lean_decode = True   # decode-only steps through DecodePlan where it applies (benchmarks.engine.step turns it off)
        self._decode_plan: DecodePlan | None = None   # built by prepack() once the linears are packed

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def lm_head(self) -> torch.Tensor | None:
        """The plain [vocab, hidden] head (the embedding when tied); None once an untied head is prepacked."""
        if self.tied_lm_head and not isinstance(self.embed_tokens, Q8Embedding):
            return self.embed_tokens
        return getattr(self.lm_head_linear, "weight", None)

    @property
    def _head_shares_embedding(self) -> bool:
        return self.tied_lm_head and not isinstance(self.embed_tokens, Q8Embedding)

    def weight_bytes(self) -> int:
        """Bytes of the checkpoint's weights as held, plain or prepacked (a tied lm_head counted once: its
        packed copy is prepacked_copy_bytes())."""
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            if t.data_ptr() in seen or t is self.rotary.cos or t is self.rotary.sin:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        for m in self.modules():
            if isinstance(m, DenseLinear | W4A16Linear) and m.prepacked:
                if not (m is self.lm_head_linear and self._head_shares_embedding):
                    total += m.weight_bytes()
        return total

    def prepacked_copy_bytes(self) -> int:
        """Extra bytes a prepacked lm_head costs when it is tied to the embedding (both layouts held)."""
        tied = self._head_shares_embedding and self.lm_head_linear.prepacked
        return self.lm_head_linear.weight_bytes() if tied else 0

    def prepack(self) -> int:
        """Prepack every dense linear for oneDNN and every INT4 linear for kernels.cpu or torch's CPU int4
        GEMM (CPU); a head tied to a Q8_0 embedding becomes a Q8Linear on the embedding's own int8 table
        (where kernels.cpu is enabled; the table interleaved in place, the lookups reading it too), dropping its
        fp32 copy. Returns how many were packed."""
        swapped = 0
        if (isinstance(self.embed_tokens, Q8Embedding) and self.tied_lm_head and self.device.type == "cpu"
                and isinstance(self.lm_head_linear, DenseLinear) and cpu_kernels.enabled()):
            self.lm_head_linear = Q8Linear.tied_to(self.embed_tokens)
            swapped = 1
        if self.device.type == "cpu" and self.dtype == torch.float32:
            self.step_ops = cpu_step_ops.ops()
        packed = swapped + sum(m.prepack() for m in self.modules()
                               if isinstance(m, DenseLinear | W4A16Linear | Int4Experts))
        self._decode_plan = DecodePlan.build(self) if self.step_ops is not None else None
        head = self.lm_head_linear
        if swapped and isinstance(head, Q8Linear) and linear_mod.HEAD_EXACT_CHANNELS:
            head.keep_exact(self.head_outlier_channels(linear_mod.HEAD_EXACT_CHANNELS))
        return packed

    def head_outlier_channels(self, num: int, tokens: int = 64) -> torch.Tensor:
        """The `num` channels of the head's input (the final norm's output) with the largest mean |x| over one
        teacher-forced forward of `tokens` pseudo-random token ids (seed 0; no text): this model's fixed
        outlier dimensions, which dominate the int8 scale of their blocks (docs/QUANTIZATION.md)."""
        ids = torch.randint(0, self.cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            h = self.scratch_prefill([ids.tolist()])
        return h.float().abs().mean(0).topk(min(num, h.shape[1])).indices

    def scratch_prefill(self, chunks: list[list[int]], kv: list[LayerKV] | None = None,
                        page_size: int = 16) -> torch.Tensor:
        """One teacher-forced forward of several sequences, each on its own pages -> hidden [sum(len), hidden].
        `kv`: a pool with at least sum(ceil(len / page_size)) pages (quant/calib.paged_prefill passes the
        engine's, in any KV dtype), else one of the model's dtype, freed on return: what prepack's calibration
        needs, without the engine's runner."""
        c, dev = self.cfg, self.device
        pages_per = [-(-len(ids) // page_size) for ids in chunks]
        if kv is None:
            shape = (sum(pages_per), page_size, c.num_kv_heads, c.head_dim)
            kv = [LayerKV(torch.zeros(shape, dtype=self.dtype, device=dev),
                          None if c.mla is not None else torch.zeros(shape, dtype=self.dtype, device=dev))  # type: ignore
                  for _ in range(c.num_layers)]
        tables = torch.zeros((len(chunks), max(pages_per)), dtype=torch.int32)
        slots, first = [], 0
        for b, (ids, n) in enumerate(zip(chunks, pages_per)):
            tables[b, :n] = torch.arange(first, first + n, dtype=torch.int32)
            slots += [first * page_size + i for i in range(len(ids))]
            first += n
        cu = [0]
        for ids in chunks:
            cu.append(cu[-1] + len(ids))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), num_decode=0,
            decode_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            prefill_block_tables=tables.to(dev), prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor([len(ids) for ids in chunks], dtype=torch.int32, device=dev),
            prefill_max_seqlen_q=max(len(ids) for ids in chunks))
        flat = torch.tensor([t for ids in chunks for t in ids], dtype=torch.long, device=dev)
        pos = torch.tensor([i for ids in chunks for i in range(len(ids))], dtype=torch.long, device=dev)
        return self(flat, pos, kv, meta)

    def linear_weight_bytes(self) -> int:
        """Bytes of the decoder layers' linears (the lm_head is not one of them)."""
        return sum(m.weight_bytes() for m in self.layers.modules()  # type: ignore[operator]
                   if hasattr(m, "weight_bytes"))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [T]  ->  hidden: [T, hidden_size]
        x = self.embed(input_ids)
        if self.step_ops is not None:
            plan = self._decode_plan
            if self.lean_decode and plan is not None and meta.num_decode == x.shape[0] and plan.applies(x, kv_caches):
                return plan.run(x, positions, kv_caches, meta, self.step_ops)
            return self._forward_cpu(x, positions, kv_caches, meta, self.step_ops)
        cos_sin = self.rotary.lookup(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos_sin, self.rotary, kv, meta)
        return self.norm(x)

    def _forward_cpu(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                     meta: AttentionMetadata, ops) -> torch.Tensor:
        """The same math as forward's layer loop, in fewer ops: x is the residual stream (updated in place); each
        residual add is fused with the RMSNorm after it (the next layer's input norm, the final norm last)."""
        layers: list[DecoderLayer] = list(self.layers)   # type: ignore[arg-type]
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        h = ops.rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for layer, kv, nxt in zip(layers, kv_caches, norms):
            a = layer.self_attn.forward_cpu(h, positions, self.rotary, kv, meta, ops)
            post = layer.post_attention_layernorm
            ops.add_rms_norm_(a, x, post.weight, post.eps)
            h = layer.mlp.forward_cpu(a, ops)
            ops.add_rms_norm_(h, x, nxt.weight, nxt.eps)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            return self.embed_tokens.index_select(0, input_ids)
        a, b = self.vocab_range   # vocab-parallel: the rows another rank holds come back in the all-reduce
        here = (input_ids >= a) & (input_ids < b)
        x = self.embed_tokens.index_select(0, torch.where(here, input_ids - a, 0))
        return self.parallel.all_reduce(x.masked_fill(~here[:, None], 0.0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head_linear(hidden).float()
        return logits if self.parallel is None else self.parallel.all_gather_cat(logits, dim=-1)


class DecodePlan:
    """_forward_cpu's layer loop for a decode-only step of the served native model, with the same ops in the same
    order (so the same bits) but without what a batch-1 step pays per layer in Python: four nn.Module calls, the
    linears' per-call layout checks and the ops' packet lookups. Measured at batch 1 on the served model (2
    threads, one process, 5 alternated pairs of 128-token generations): median 188.5 -> 234.2 tok/s (1.24x).
    Applies when every decoder linear is a bias-free Q4_1 x8 W4A16Linear with a fused gate_up (the GGUF
    default) and the rows are under linear.DENSE_MIN_ROWS (any KV dtype: the rope op quantizes fp8 pages as it
    stores them); otherwise the model runs _forward_cpu (docs/KERNELS.md)."""

    def __init__(self, model: LlamaModel, first: RMSNorm, layers: list[tuple], residual: bool, tau: float) -> None:
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
    def build(cls, model: LlamaModel) -> DecodePlan | None:
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

def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed safetensors index ({e})") from e
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: names shard {f.name!r}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(path):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    # a copy: get_tensor's tensors view the file's mapping, which then stays mapped (and its
                    # pages in this process's RSS: the whole 92 MB of the default model) for as long as any
                    # of them lives, though prepack replaces most of them
                    tensors[name] = fh.get_tensor(name).clone()
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({type(e).__name__}: {e})") from e
    return tensors


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                make_linear=None, source: str = "", fuse_gate_up: bool | None = None,
                prepack: bool = False) -> LlamaModel:
    """Assemble the model; `make_linear(prefix_list, tensors) -> nn.Module` builds (fused) linears;
    `prepack` packs dense linears for oneDNN where the device and dtype allow it."""

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"{source}: missing tensor {name!r}")
        return tensors[name]

    def check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=dtype)

    def dense(names: list[str], shapes: list[tuple[int, int]], bias: bool = False) -> nn.Module:
        ws = [check(n + ".weight", take(n + ".weight"), s) for n, s in zip(names, shapes)]
        bs = [check(n + ".bias", take(n + ".bias"), (s[0],)) for n, s in zip(names, shapes)] if bias else None
        return DenseLinear(torch.cat(ws).contiguous(), torch.cat(bs) if bs else None)

    if fuse_gate_up is None:          # split only for plain-layout dense GEMMs (two were faster on CPU)
        fuse_gate_up = make_linear is not None or prepack
    make_linear = make_linear or dense
    h, c = cfg.hidden_size, cfg

    def mlp(p: str, inter: int) -> MLP:   # p: "model.layers.i.mlp." (or its shared_experts.)
        shape = (inter, h)
        if fuse_gate_up:
            gate_up = make_linear([p + "gate_proj", p + "up_proj"], [shape, shape])
        else:
            gate_up = (make_linear([p + "gate_proj"], [shape]), make_linear([p + "up_proj"], [shape]))
        return MLP(gate_up, make_linear([p + "down_proj"], [(h, inter)]))

    def norm(name: str, size: int) -> RMSNorm:
        return RMSNorm(check(name, take(name), (size,)), cfg.rms_norm_eps)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn: Attention | MLAAttention
        if cfg.mla is not None:
            attn = _mla_attention(cfg, p + "self_attn.", tensors, take, norm, make_linear, dtype, device, source)
        else:
            qkv = make_linear([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
                              [(c.q_size, h), (c.kv_size, h), (c.kv_size, h)], bias=cfg.attention_bias)
            o = make_linear([p + "self_attn.o_proj"], [(h, c.q_size)])
            qk_norms = ((norm(p + "self_attn.q_norm.weight", c.head_dim),
                         norm(p + "self_attn.k_norm.weight", c.head_dim)) if cfg.qk_norm else (None, None))
            attn = Attention(cfg, qkv, o, *qk_norms)
        ffn: MLP | SparseMoE
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            ffn = _sparse_moe(cfg, p + "mlp.", tensors, take, mlp, make_linear, dtype, device, source)
        else:
            ffn = mlp(p + "mlp.", c.intermediate_size)
        layers.append(DecoderLayer(attn, ffn, norm(p + "input_layernorm.weight", h),
                                   norm(p + "post_attention_layernorm.weight", h)))
    embed: torch.Tensor | Q8Embedding
    if "model.embed_tokens.weight" not in tensors and "model.embed_tokens.qweight" in tensors:
        from edgeinfer.backend.quant.loader import q8_embedding

        embed = q8_embedding(tensors, (cfg.vocab_size, h), dtype, device, source)
    else:
        embed = check("model.embed_tokens.weight", take("model.embed_tokens.weight"), (cfg.vocab_size, h))
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = check("lm_head.weight", take("lm_head.weight"), (cfg.vocab_size, h))
    norm = RMSNorm(check("model.norm.weight", take("model.norm.weight"), (h,)), cfg.rms_norm_eps)
    model = LlamaModel(cfg, embed, layers, norm, lm_head, device).eval()
    if prepack:
        model.prepack()
    return model


def _permute_rows(tensors: dict[str, torch.Tensor], prefix: str, perm: torch.Tensor, source: str) -> None:
    """Reorder dim 0 of every row-indexed tensor of the linear at prefix (weight, bias, or a quantized layout's
    qweight / scales / zeros / mins / weight_packed / weight_scale): rows are independent in all of them."""
    n = perm.numel()
    found = False
    for name in [k for k in tensors if k.startswith(prefix + ".")]:
        t = tensors[name]
        if t.dim() >= 1 and t.shape[0] == n and not name.endswith("weight_shape"):
            tensors[name] = t.index_select(0, perm)
            found = True
    if not found:
        raise CheckpointError(f"{source}: no tensor with {n} rows under {prefix!r} to reorder for rope")


def _mla_attention(cfg: ModelConfig, p: str, tensors: dict[str, torch.Tensor], take, norm, make_linear,
                   dtype: torch.dtype, device: torch.device, source: str) -> MLAAttention:
    """DeepSeek-V3 attention at prefix p ("model.layers.i.self_attn."): q_a_proj, q_a_layernorm, q_b_proj (or
    q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj (kept dense: decode folds it into the query and the
    output), o_proj. Interleaved rope rows are reordered to rotate-half layout here (backend/model/mla.py)."""
    m = cfg.mla
    assert m is not None
    h, heads = cfg.hidden_size, cfg.num_heads
    q_rows = heads * m.qk_head_dim
    q_name = p + ("q_b_proj" if m.q_lora_rank else "q_proj")
    if m.rope_interleave:
        halves = interleave_to_halves(m.qk_rope_head_dim)
        per_head = torch.cat((torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + halves))
        _permute_rows(tensors, q_name, (torch.arange(heads)[:, None] * m.qk_head_dim + per_head).reshape(-1), source)
        _permute_rows(tensors, p + "kv_a_proj_with_mqa",
                      torch.cat((torch.arange(m.kv_lora_rank), m.kv_lora_rank + halves)), source)
    if m.q_lora_rank:
        q_a = make_linear([p + "q_a_proj"], [(m.q_lora_rank, h)], bias=cfg.attention_bias)
        q_a_norm = norm(p + "q_a_layernorm.weight", m.q_lora_rank)
        q_b = make_linear([q_name], [(q_rows, m.q_lora_rank)])
    else:
        q_a = q_a_norm = None
        q_b = make_linear([q_name], [(q_rows, h)])
    kv_a = make_linear([p + "kv_a_proj_with_mqa"], [(m.latent_dim, h)], bias=cfg.attention_bias)
    kv_a_norm = norm(p + "kv_a_layernorm.weight", m.kv_lora_rank)
    kv_b_shape = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    kv_b_mod = make_linear([p + "kv_b_proj"], [kv_b_shape])
    kv_b = dense_weight(kv_b_mod).to(device=device, dtype=dtype)
    o = make_linear([p + "o_proj"], [(h, heads * m.v_head_dim)], bias=cfg.attention_bias)
    return MLAAttention(cfg, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o)


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """[out, in] of a DenseLinear or (dequantized) W4A16Linear that is not prepacked."""
    if isinstance(linear, DenseLinear) and linear.weight is not None:
        return linear.weight.data
    if isinstance(linear, W4A16Linear) and not linear.prepacked:
        from edgeinfer.backend.quant.packing import group_dequantize_mins
        from edgeinfer.kernels.w4a16_gemm import group_dequantize_tensor

        if linear.mins is not None:
            return group_dequantize_mins(linear.qweight, linear.scales, linear.mins, linear.group_size)
        return group_dequantize_tensor(linear.qweight, linear.scales, linear.zeros, linear.group_size)
    raise TypeError(f"no plain weight in {type(linear).__name__} (prepacked?)")


def _sparse_moe(cfg: ModelConfig, p: str, tensors: dict[str, torch.Tensor], take, mlp, make_linear,
                dtype: torch.dtype, device: torch.device, source: str) -> SparseMoE:
    """The MoE block at prefix p ("model.layers.i.mlp."): router `gate.weight` [E, H] (kept fp32) and, for sigmoid
    routing, `gate.e_score_correction_bias` [E]; the routed experts per expert (`experts.<e>.{gate,up,down}_proj`,
    plain or quantized: INT4 ones become one Int4Experts) or fused (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]); `shared_experts.*` when n_shared_experts > 0."""
    moe = cfg.moe
    assert moe is not None
    h, e, inter = cfg.hidden_size, moe.num_experts, moe.intermediate_size

    def fp32(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = take(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=torch.float32)

    router = fp32(p + "gate.weight", (e, h))
    bias = fp32(p + "gate.e_score_correction_bias", (e,)) if moe.scoring == "sigmoid" else None
    experts: DenseExperts | Int4Experts
    if p + "experts.gate_up_proj" in tensors:
        gate_up = take(p + "experts.gate_up_proj")
        down = take(p + "experts.down_proj")
        if tuple(gate_up.shape) != (e, 2 * inter, h) or tuple(down.shape) != (e, h, inter):
            raise CheckpointError(f"{source}: {p}experts gate_up_proj {tuple(gate_up.shape)} / down_proj "
                                  f"{tuple(down.shape)}: expected {(e, 2 * inter, h)} / {(e, h, inter)}")
        experts = DenseExperts(gate_up.to(device=device, dtype=dtype), down.to(device=device, dtype=dtype))
    else:
        ep = [f"{p}experts.{j}." for j in range(e)]
        gu = [make_linear([q + "gate_proj", q + "up_proj"], [(inter, h), (inter, h)]) for q in ep]
        dn = [make_linear([q + "down_proj"], [(h, inter)]) for q in ep]
        if all(isinstance(m, W4A16Linear) for m in gu + dn):
            experts = Int4Experts.from_linears(gu, dn)
        elif all(isinstance(m, DenseLinear) for m in gu + dn):
            experts = DenseExperts(torch.stack([m.weight for m in gu]), torch.stack([m.weight for m in dn]))
        else:
            raise CheckpointError(f"{source}: {p}experts mix INT4 and unquantized experts; expected all or none")
    shared = mlp(p + "shared_experts.", moe.n_shared_experts * inter) if moe.n_shared_experts else None
    return SparseMoE(moe, router, experts, shared, bias)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               fuse_gate_up: bool | None = None, prepack: bool | None = None) -> LlamaModel:
    """prepack=None: pack dense linears for oneDNN on CPU unless EDGEINFER_CPU_PREPACK=0. Code that
    reads or rewrites weights (the quantizer) passes prepack=False."""
    path = Path(path)
    if prepack is None:
        prepack = torch.device(device).type == "cpu" and cpu_prepack_enabled()
    cfg = ModelConfig.from_dir(path)
    tensors = read_tensors(path)
    make_linear = None
    if cfg.quantization is not None:
        from edgeinfer.backend.quant.loader import quantized_linear_factory

        make_linear = quantized_linear_factory(cfg, tensors, dtype, torch.device(device), source=str(path))
    return build_model(cfg, tensors, dtype, torch.device(device), make_linear, source=str(path),
                       fuse_gate_up=fuse_gate_up, prepack=prepack)
