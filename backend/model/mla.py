"""Multi-head Latent Attention (DeepSeek-V3, Kimi K2) over a paged latent KV cache.

Per token and layer the cache holds one row: the normalized latent c = norm(W_DKV x) (kv_lora_rank values) and the
rotated shared rope key k_pe (qk_rope_head_dim), 576 values for Kimi K2 (kernels/paged_mla_attention.py). The
query comes through the q LoRA (q_a_proj, its RMSNorm, q_b_proj) or one q_proj; each head's query is a nope part
and a rope part. kv_b_proj [heads * (nope + v), kv_lora_rank] holds W_UK (per head [nope, r]) and W_UV ([v, r]).

- Decode uses the absorbed form: q_lat = W_UK^T q_nope per head, so every head scores [q_lat, q_pe] against the
  latent rows themselves (kernels.paged_mla_decode_attention), and W_UV is applied to the attended latent: the
  step reads only the latent pages, never a per-head K or V.
- Prefill attends either expanded (the chunk's context latents -> K and V per head through kv_b_proj, then causal
  attention; `prefill_form = "expanded"`, the default) or in the latent form as decode does (`"latent"`);
  benchmarks/mla.py measures both.

RoPE: the checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`); the loader permutes the
rows that produce q_pe and k_pe to (x0, x2, ..., x1, x3, ...) once, so the usual rotate-half rope gives the same
dot products (transformers computes it the same way). YaRN's mscale is in the config's softmax scale.
"""

from __future__ import annotations

import torch
from torch import nn

import edgeinfer.kernels.cpu as cpu_kernels
from edgeinfer import kernels
from edgeinfer.backend.model.model_config import MLAConfig, ModelConfig
from edgeinfer.kernels.kv_store import quantized
from edgeinfer.kernels.paged_mla_attention import gather_latents
from edgeinfer.kernels.w4a16_gemm import pack_uint4

Q4 = 32   # GGUF block


def q4_0_exact_x8(w: torch.Tensor) -> torch.Tensor | None:
    """w [E, N, K] fp32 whose every 32-value block along K is a dequantized GGUF Q4_0 block (values d * (q - 8),
    d fp16, q 0..15; ggml's quantizer gives the block's largest-magnitude value q = 0, so d = -that value / 8) ->
    kernels.cpu's grouped-GEMM layout [E, ceil(N/8), K/32 * 160] holding exactly those values as Q4_1 (scale d,
    min -8d); None where any block is not such a block (a checkpoint saved in fp32: its maps stay fp32)."""
    e, n, k = w.shape
    if k % Q4 or w.dtype != torch.float32:
        return None
    b = w.reshape(e, n, k // Q4, Q4)
    d = -b.gather(-1, b.abs().argmax(-1, keepdim=True)) / 8                     # [E, N, nb, 1]
    if not torch.equal(d.to(torch.float16).float(), d):
        return None
    q = b / torch.where(d == 0, torch.ones_like(d), d) + 8
    if not (torch.equal(q, q.round()) and bool(((q >= 0) & (q <= 15)).all()) and torch.equal(d * (q - 8), b)):
        return None
    d16 = d[..., 0].to(torch.float16)                                            # [E, N, nb]
    packed = []
    for i in range(e):
        blocks = cpu_kernels.pack_q4_1(pack_uint4(q[i].reshape(n, k)), d16[i], -8 * d16[i], Q4)
        packed.append(cpu_kernels.pack_q4_1x8(blocks))
    return torch.stack(packed).contiguous()


def interleave_to_halves(rope_dim: int) -> torch.Tensor:
    """The row order that turns interleaved rope pairs into rotate-half layout: evens, then odds."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, q_a: nn.Module | None, q_a_norm: nn.Module | None, q_b: nn.Module,
                 kv_a: nn.Module, kv_a_norm: nn.Module, kv_b: torch.Tensor, o: nn.Module) -> None:
        super().__init__()
        assert cfg.mla is not None
        self.cfg, self.mla = cfg, cfg.mla
        m: MLAConfig = cfg.mla
        self.q_a_proj, self.q_a_layernorm, self.q_b_proj = q_a, q_a_norm, q_b   # q_b: q_proj without a q LoRA
        self.kv_a_proj, self.kv_a_layernorm, self.o_proj = kv_a, kv_a_norm, o
        w = kv_b.view(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        # W_UK [heads, nope, r] and W_UV [heads, v, r]: the absorbed decode's two per-head maps
        self.w_uk = nn.Parameter(w[:, : m.qk_nope_head_dim].contiguous(), requires_grad=False)
        self.w_uv = nn.Parameter(w[:, m.qk_nope_head_dim:].contiguous(), requires_grad=False)
        self.scale = m.softmax_scale
        self.uk_x8: torch.Tensor | None = None   # CPU prepack: W_UK / W_UV as per-head INT4 (q4_0_exact_x8)
        self.uv_x8: torch.Tensor | None = None
        self.residual_activations, self.second_pass_tau = False, 0.0
        self.prefill_form = "expanded"
        self.decode_form = "absorbed"   # "expanded": re-expand every context latent each step (the mla benchmark's baseline)
        self.norms_or_partial_rope = True   # never the fused GQA rope op or DecodePlan

    def _q_and_latent(self, x: torch.Tensor, cos_sin, rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent rows [T, r + rope] (c normalized, k_pe
        rotated)."""
        m, t = self.mla, x.shape[0]
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_b_proj(x)
        q = q.view(t, self.cfg.num_heads, m.qk_head_dim)
        ckv = self.kv_a_proj(x)
        c = self.kv_a_layernorm(ckv[:, : m.kv_lora_rank])
        pe = rotary.rotate(cos_sin, torch.cat((q[..., m.qk_nope_head_dim:], ckv[:, None, m.kv_lora_rank:]), 1))
        latent = torch.cat((c, pe[:, -1].to(c.dtype)), -1)
        return q[..., : m.qk_nope_head_dim], pe[:, :-1].to(q.dtype), latent

    def forward(self, x: torch.Tensor, cos_sin, rotary, kv, meta, ops=None) -> torch.Tensor:
        """ops: kernels.cpu.attn's ops (the CPU path): the absorbed decode attends through their
        mla_decode_attention, which reads the latent pages in their stored dtype."""
        m, t = self.mla, x.shape[0]
        q_nope, q_pe, latent = self._q_and_latent(x, cos_sin, rotary)
        kernels.mla_latent_store(latent, kv.k, meta.slot_mapping, kv.k_scale)
        nd = meta.num_decode
        parts = []
        if nd:
            if self.decode_form == "absorbed":
                parts.append(self.decode(q_nope[:nd], q_pe[:nd], kv, meta, ops))
            else:
                parts.append(self.decode_expanded(q_nope[:nd], q_pe[:nd], kv, meta))
        if t > nd:
            if self.prefill_form == "expanded":
                parts.append(self.prefill_expanded(q_nope[nd:], q_pe[nd:], kv, meta))
            else:
                parts.append(self.prefill_latent(q_nope[nd:], q_pe[nd:], kv, meta, ops))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.o_proj(out.reshape(t, self.cfg.num_heads * m.v_head_dim))

    def forward_cpu(self, x: torch.Tensor, positions: torch.Tensor, rotary, kv, meta, ops) -> torch.Tensor:
        return self.forward(x, rotary.lookup(positions), rotary, kv, meta, ops)

    def prepack(self) -> bool:
        """CPU: W_UK and W_UV for kernels.cpu's grouped INT4 GEMM (one group a head: the step reads 4-bit maps, not
        fp32 ones), where their values are exactly a GGUF's Q4_0 blocks along their input (a deepseek2 GGUF's k_b and
        v_b, which the import dequantized); else False and the fp32 einsums stay. The fp32 maps are kept: the expanded
        prefill reads them."""
        if self.w_uk.device.type != "cpu" or not cpu_kernels.enabled():
            return False
        uk = q4_0_exact_x8(self.w_uk.data.transpose(1, 2).contiguous())   # per head [r, nope]: input q_nope
        uv = q4_0_exact_x8(self.w_uv.data)                                 # per head [v, r]: input the latent
        if uk is None or uv is None:
            return False
        self.uk_x8, self.uv_x8 = uk, uv
        self.residual_activations = cpu_kernels.activations() == "int8x2"
        self.second_pass_tau = cpu_kernels.second_pass_tau()
        return True

    def _per_head(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x [T, H, K] through head h's INT4 map of packed (q4_0_exact_x8) -> [T, H, n]: one grouped GEMM."""
        t, h, k = x.shape
        rows = x.transpose(0, 1).reshape(h * t, k).contiguous()
        offsets = torch.arange(h + 1, dtype=torch.int64) * t
        y = cpu_kernels.q4_1x8_moe_gemm(rows, packed, n, offsets, self.residual_activations, self.second_pass_tau)
        return y.view(h, t, n).transpose(0, 1)

    def _op_shapes(self, q: torch.Tensor, cache: torch.Tensor) -> bool:
        """Whether the CPU ops take this query over this cache (kernels/cpu/attn.cpp check_mla: fp32, a row width
        that is a multiple of 8, a latent width that is a multiple of 8, of 16 on fp8 / int8 pages), else torch."""
        step = 16 if quantized(cache.dtype) else 8
        return q.dtype == torch.float32 and q.shape[-1] % 8 == 0 and self.mla.kv_lora_rank % step == 0

    # ---- the two forms
    def absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[T, H, nope], [T, H, rope] -> [T, H, r + rope]: W_UK folded into the query."""
        q_lat = torch.einsum("thn,hnr->thr", q_nope.to(self.w_uk.dtype), self.w_uk)
        return torch.cat((q_lat, q_pe.to(q_lat.dtype)), -1)

    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv, meta, ops=None) -> torch.Tensor:
        """One query per decoding sequence, reading only the latent pages -> [B, H, v]."""
        native = ops is not None and self.uk_x8 is not None and q_nope.dtype == torch.float32
        if native:
            assert self.uk_x8 is not None
            q = torch.cat((self._per_head(q_nope, self.uk_x8, self.mla.kv_lora_rank), q_pe), -1)
        else:
            q = self.absorbed_query(q_nope, q_pe)
        attend = kernels.paged_mla_decode_attention
        if ops is not None and self._op_shapes(q, kv.k):
            attend = ops.mla_decode_attention
        o_lat = attend(q.contiguous(), kv.k, meta.decode_block_tables, meta.decode_context_lens, self.scale,
                       self.mla.kv_lora_rank, kv.k_scale)
        if native:
            assert self.uv_x8 is not None
            return self._per_head(o_lat, self.uv_x8, self.mla.v_head_dim)
        return torch.einsum("bhr,hvr->bhv", o_lat.to(self.w_uv.dtype), self.w_uv)

    def decode_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv, meta) -> torch.Tensor:
        """The non-absorbed decode, for comparison only: each sequence's context latents expanded through kv_b_proj
        to per-head K and V every step (what a cache of expanded K/V would hold), then attention."""
        out = torch.empty(q_nope.shape[0], self.cfg.num_heads, self.mla.v_head_dim, dtype=q_nope.dtype,
                          device=q_nope.device)
        for j, n in enumerate(meta.decode_context_lens.tolist()):
            out[j] = self._expanded(q_nope[j:j + 1], q_pe[j:j + 1], kv, meta.decode_block_tables[j], n)[0]
        return out

    def _chunks(self, meta):
        cu = meta.prefill_cu_seqlens_q.tolist()
        lens = meta.prefill_context_lens.tolist()
        for j in range(len(lens)):
            yield j, cu[j], cu[j + 1], lens[j]

    def prefill_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv, meta) -> torch.Tensor:
        """Each chunk's context latents expanded through kv_b_proj to per-head K and V, causal attention."""
        out = torch.empty(q_nope.shape[0], self.cfg.num_heads, self.mla.v_head_dim, dtype=q_nope.dtype,
                          device=q_nope.device)
        for j, a, b, n in self._chunks(meta):
            out[a:b] = self._expanded(q_nope[a:b], q_pe[a:b], kv, meta.prefill_block_tables[j], n)
        return out

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv, block_table: torch.Tensor, n: int
                  ) -> torch.Tensor:
        """The last L of a sequence's n positions, [L, H, nope] and [L, H, rope], against its n context latents
        expanded to per-head K (W_UK c, k_pe) and V (W_UV c) -> [L, H, v] in q's dtype."""
        m, h = self.mla, self.cfg.num_heads
        lat = kernels_gather(kv, block_table, n, self.w_uk.dtype)
        c, k_pe = lat[:, : m.kv_lora_rank], lat[:, m.kv_lora_rank:]
        k = torch.cat((torch.einsum("hnr,cr->hcn", self.w_uk, c), k_pe[None].expand(h, -1, -1)), -1)  # [H, n, d]
        v = torch.einsum("hvr,cr->hcv", self.w_uv, c)
        q = torch.cat((q_nope, q_pe), -1).transpose(0, 1).to(c.dtype)                                  # [H, L, d]
        return _causal(q, k, v, n, self.scale).transpose(0, 1).to(q_nope.dtype)

    def prefill_latent(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv, meta, ops=None) -> torch.Tensor:
        """The chunk attends in the latent form, as decode does (scores against the 576-wide rows); with the CPU
        ops, through their mla_prefill_attention (causal, reading the pages in their stored dtype)."""
        m = self.mla
        q_all = self.absorbed_query(q_nope, q_pe)
        if ops is not None and self._op_shapes(q_all, kv.k):
            o_lat = ops.mla_prefill_attention(q_all.contiguous(), kv.k, meta.prefill_block_tables,
                                              meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale,
                                              m.kv_lora_rank, kv.k_scale)
            return torch.einsum("thr,hvr->thv", o_lat, self.w_uv).to(q_nope.dtype)
        out = torch.empty(q_nope.shape[0], self.cfg.num_heads, m.v_head_dim, dtype=q_nope.dtype,
                          device=q_nope.device)
        for j, a, b, n in self._chunks(meta):
            lat = kernels_gather(kv, meta.prefill_block_tables[j], n, q_all.dtype)
            o_lat = _causal(q_all[a:b].transpose(0, 1), lat[None], lat[None, :, : m.kv_lora_rank], n, self.scale)
            out[a:b] = torch.einsum("hlr,hvr->lhv", o_lat, self.w_uv).to(out.dtype)
        return out


def kernels_gather(kv, block_table: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    return gather_latents(kv.k, kv.k_scale, block_table, n, dtype)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """q [H, L, d] (the last L of n positions), k [H|1, n, d], v [H|1, n, dv] -> [H, L, dv]."""
    length = q.shape[1]
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - length, n, device=q.device)[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(p, v.float())
