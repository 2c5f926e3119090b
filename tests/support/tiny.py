"""A tiny random Llama checkpoint (transformers' own classes, saved as safetensors) and prompts for it; the engine
driven step by step on the test's thread is tests/support/engine_steps.py."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300


def tiny_llama(path: Path, seed: int = 0, max_position: int = 512) -> Path:
    """2 layers, 8 heads over 2 KV heads, weights scaled x3 (sharp logits: greedy choices rarely tie)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                     num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=max_position,
                                     tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
    m.save_pretrained(path, safe_serialization=True)
    return path


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()
