"""Tiny random Mixture-of-Experts checkpoints built with transformers' own config and model classes (the oracle):
Qwen3-MoE, GLM-4.5 (Glm4Moe) and DeepSeek-V3, a few layers of 16 experts, top-4, 2 groups.

Random init leaves the routers near-uniform and the correction bias at zero, which would let a routing bug hide:
the router weights are scaled up, every `e_score_correction_bias` is drawn large enough to move the top-k choice,
and the 2-D weights are sharpened so greedy decoding is not a coin toss.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_compat import hide_hub_kernels

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts_per_tok=4, max_position_embeddings=512,
              tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None, rms_norm_eps=1e-6)


def config(kind: str, **overrides):
    hide_hub_kernels()
    from transformers import DeepseekV3Config, Glm4MoeConfig, Qwen3MoeConfig

    if kind == "qwen3_moe":
        kw = dict(COMMON, num_hidden_layers=3, num_experts=16, norm_topk_prob=True, mlp_only_layers=[1])
        return Qwen3MoeConfig(**(kw | overrides))
    if kind == "glm4_moe":
        kw = dict(COMMON, num_hidden_layers=3, n_routed_experts=16, n_group=2, topk_group=1, first_k_dense_replace=1,
                  n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                  attention_bias=True, partial_rotary_factor=0.5)
        return Glm4MoeConfig(**(kw | overrides))
    if kind == "deepseek_v3":
        kw = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=16, n_group=2, topk_group=1,
                  first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32,
                  q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        kw.pop("head_dim")
        return DeepseekV3Config(**(kw | overrides))
    raise ValueError(f"unknown MoE kind {kind!r}; expected qwen3_moe, glm4_moe or deepseek_v3")


def build(kind: str, out: Path | None = None, seed: int = 0, sharpen: float = 3.0, **overrides):
    """The transformers model (eval, fp32), saved as safetensors + config.json to `out` if given."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind, **overrides)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "gate.weight" not in name:
                p.mul_(sharpen)
            elif "gate.weight" in name:             # the router: spread the expert scores
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    if out is not None:
        model.save_pretrained(out, safe_serialization=True)
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def servable(kind: str, out: Path, tokenizer_dir: Path, **overrides):
    """A tiny checkpoint with the vocabulary (and chat template) of the checkpoint at tokenizer_dir, so the engine and
    `edgeinfer serve --model out` can run it; the tokenizer files are copied beside the weights."""
    import json
    import shutil

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    model = build(kind, out, vocab_size=vocab, **overrides)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    return model
