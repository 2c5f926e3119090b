"""The decoder's layers over a paged KV cache: RMSNorm, rotary embedding, GQA attention (fused QKV, optional
per-head QK-norm and partial rotary), the gated MLP (fused gate/up) and the decoder layer that joins them.
Attention reads K/V through block tables (kernels.paged_*_attention); a layer never holds a dense per-request
KV tensor."""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer import kernels
from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV
from edgeinfer.backend.model.mla import MLAAttention
from edgeinfer.backend.model.model_config import ModelConfig, rope_inv_freq
from edgeinfer.backend.model.moe import SparseMoE
from edgeinfer.kernels.cpu.attn_reference import hadamard_heads_


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
