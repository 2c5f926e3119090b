"""The one paged decoder every supported checkpoint runs as: the dense Llama, Mistral and Qwen2, the
Mixture-of-Experts Qwen3-MoE and GLM-4.5/4.6 (GQA attention with per-head QK-norm and partial rotary where the
config asks; the MLP of a sparse layer is backend/model/moe.py's SparseMoE) and DeepSeek-V3 / Kimi K2 (MLA
attention: backend/model/mla.py). Built by backend/model/loader.py.

One forward runs a flat batch of tokens: the decode tokens of B_d sequences first, then the prefill chunks. On
CPU (fp32 activations) prepack() picks the fused step ops and, for decode-only steps of the native INT4 model,
backend/model/cpu_decode.py's DecodePlan.
"""

from __future__ import annotations

import torch
from torch import nn

import edgeinfer.backend.model.linear as linear_mod
import edgeinfer.kernels.cpu as cpu_kernels
import edgeinfer.kernels.cpu.attn as cpu_step_ops
from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV, PageIO
from edgeinfer.backend.model.cpu_decode import DecodePlan
from edgeinfer.backend.model.layers import DecoderLayer, RMSNorm, Rotary
from edgeinfer.backend.model.linear import (
    DenseLinear,
    Q8Embedding,
    Q8Linear,
    W4A16Linear,
)
from edgeinfer.backend.model.mla import MLAAttention
from edgeinfer.backend.model.model_config import ModelConfig
from edgeinfer.backend.model.moe import Int4Experts
from edgeinfer.backend.model.mtp import MTPLayer


class DecoderModel(nn.Module):
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
        self.mtp: MTPLayer | None = None   # the checkpoint's MTP layer, when loaded for speculative decoding

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
                               if isinstance(m, DenseLinear | W4A16Linear | Int4Experts | MLAAttention))
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

    def page_io(self, kv: list[LayerKV]) -> PageIO:
        """How the engine moves page bodies in and out of this model's KV pool `kv`."""
        return PageIO(kv)

    def stop_workers(self) -> None:
        """One process: no other rank to stop (PagedModel)."""

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head_linear(hidden).float()
        return logits if self.parallel is None else self.parallel.all_gather_cat(logits, dim=-1)
