"""Write a checkpoint with random weights of a config's shapes: what benchmarks/gpu_check.sh times the engine on
when no SmolLM2 checkpoint reached the GPU machine (decode speed depends on the shapes, not the values).

  python -m benchmarks.harness.checkpoints benchmarks/data/smollm2_config.json OUT_DIR [--scale-config tiny]

--scale-config tiny shrinks the model (hidden 64, 2 layers) for the CPU dry run. No tokenizer is written:
bench_engine runs on token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048}


def random_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h)}
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = w(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
              p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
              p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
              p + "mlp.down_proj.weight": w(h, inter),
              p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)}
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--scale-config", choices=["full", "tiny"], default="full")
    args = ap.parse_args()
    cfg = json.loads(args.config.read_text())
    if args.scale_config == "tiny":
        cfg |= TINY
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(random_tensors(cfg), str(args.out / "model.safetensors"))
    print(f"wrote random {args.scale_config} checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
