"""The multi-token-prediction (MTP, "NextN") layer that DeepSeek-V3 / Kimi K2 and GLM-4.5/4.6 checkpoints ship after
their decoder layers (`num_nextn_predict_layers` = 1: tensors `model.layers.<num_hidden_layers>.*`), used as the
draft model of speculative decoding (backend/engine/spec/, `--speculative mtp`).

At position i it combines the main model's final hidden state h_i (after the final norm: what vLLM and SGLang hand
their MTP modules) with the embedding of the token at i + 1 and predicts the token at i + 2 (DeepSeek-V3 report,
section 2.2):

    x_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])          eh_proj: [hidden, 2 * hidden]
    y   = block(x)            one decoder layer (attention over its own KV of the positions before, then MLP / MoE)
    logits_i = shared_head.head(shared_head.norm(y_i))          the main lm_head where the checkpoint has no own head

Its KV is one more layer beside the pool's (backend/engine/model_runner.py: same pages, same slots, not part of a
page's body: a page moved between nodes or tiers carries the main layers only and arrives with its MTP rows
zeroed). transformers drops these tensors, so the engine's own reference is tests/backend/engine/test_mtp.py's
full-sequence recomputation with transformers' decoder layer.
"""

from __future__ import annotations

import torch
from torch import nn

from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV
from edgeinfer.backend.model.layers import DecoderLayer, RMSNorm

# the MTP layer's own tensors under model.layers.<L>. (the block's are the usual decoder-layer names)
MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


class MTPLayer(nn.Module):
    def __init__(self, enorm: RMSNorm, hnorm: RMSNorm, eh_proj: nn.Module, block: DecoderLayer, head_norm: RMSNorm,
                 head: nn.Module | None) -> None:
        super().__init__()
        self.enorm, self.hnorm, self.eh_proj, self.block = enorm, hnorm, eh_proj, block
        self.head_norm = head_norm
        self.head = head          # None: the main model's lm_head (checkpoints that store no shared_head.head)

    def forward(self, model, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv: LayerKV,
                meta: AttentionMetadata) -> torch.Tensor:
        """next_ids [T] (the token after each position), positions [T], hidden [T, H] (the main model's output at
        those positions) -> the block's output [T, H]; the block's KV stored at meta.slot_mapping."""
        e = self.enorm(model.embed(next_ids).to(hidden.dtype))
        x = self.eh_proj(torch.cat((e, self.hnorm(hidden)), -1))
        b = self.block
        ops = model.step_ops
        if ops is not None:
            a = b.self_attn.forward_cpu(b.input_layernorm(x), positions, model.rotary, kv, meta, ops)
            x = x + a
            return x + b.mlp.forward_cpu(b.post_attention_layernorm(x), ops)
        return b(x, model.rotary.lookup(positions), model.rotary, kv, meta)

    def logits(self, model, y: torch.Tensor) -> torch.Tensor:
        h = self.head_norm(y)
        if self.head is None:
            return model.compute_logits(h)
        return self.head(h).float()
