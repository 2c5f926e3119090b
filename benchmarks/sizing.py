"""Weight bytes, KV bytes per token and the sequences that fit, for Kimi K2 and GLM-4.6 on one 8 x H200 node:
the seed's "FP8 KV doubles context" and "INT4 weights ~40% smaller" claims computed for the models themselves.

  python -m benchmarks sizing [--gpus 8] [--gpu-gb 141] [--reserve 0.08] [--out FILE]

Parameter counts come from each model's published config (the field names of transformers' config classes) by
the formulas in `parameters()`, which tests/benchmarks/test_model_sizing.py checks against transformers' own
count on small configs of the same classes. Bytes per weight:
  bf16   2
  fp8    1 + one fp32 scale per 128 x 128 block (DeepSeek-V3's FP8 layout) on every linear; norms, router bf16
  int4   routed experts 4-bit with a bf16 scale per 32 weights (4.5 bits: Kimi-K2-Thinking's compressed-tensors
         W4A16); everything else bf16 (as that checkpoint ships: attention, shared experts, dense layers, head)
  int4-all  every decoder linear 4.5 bits (what edgeinfer's quantizer or a Q4_0 GGUF gives), embeddings bf16
KV bytes per token and layer:
  MLA latent  (kv_lora_rank + qk_rope_head_dim) values: 576 for Kimi K2 (one latent + one shared rope key)
  GQA         2 * num_key_value_heads * head_dim values
  fp8 adds one fp32 scale per token per (latent | kv head) and K/V, as edgeinfer's fp8 pages store them.
Sequences that fit = (HBM * (1 - reserve) - weights) / (KV bytes per token * context); reserve covers activations,
CUDA graphs and fragmentation (8% by default, a stated assumption, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Published configs (config.json of moonshotai/Kimi-K2-Instruct and zai-org/GLM-4.6), the fields sizing needs.
KIMI_K2 = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840, "hidden_size": 7168,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
           "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
           "num_experts_per_tok": 8, "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False}
GLM_46 = {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 5120,
          "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
          "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 160,
          "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "attention_bias": True,
          "use_qk_norm": False, "tie_word_embeddings": False}
MODELS = {"Kimi K2": KIMI_K2, "GLM-4.6": GLM_46}


def parameters(cfg: dict) -> dict[str, int]:
    """Parameter counts by part: embed, head, attention, dense_mlp, shared_experts, routed_experts, router, norms
    (MTP layers, which serving does not load, excluded)."""
    h, layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    dense_layers = cfg.get("first_k_dense_replace", 0)
    sparse_layers = layers - dense_layers
    e, inter, moe_inter = cfg["n_routed_experts"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    mla = "kv_lora_rank" in cfg
    if mla:
        heads, nope, rope, vd = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                                 cfg["v_head_dim"])
        q_rank, kv_rank = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        q = h * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + vd)
        attn = q + kv + heads * vd * h
        attn_norms = 0
    else:
        heads, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        attn = h * (heads + 2 * kvh) * hd + heads * hd * h
        if cfg.get("attention_bias"):
            attn += (heads + 2 * kvh) * hd
        attn_norms = 2 * hd if cfg.get("use_qk_norm") else 0
    out = {
        "embed": v * h,
        "head": 0 if cfg.get("tie_word_embeddings") else v * h,
        "attention": layers * (attn + attn_norms),
        "dense_mlp": dense_layers * 3 * h * inter,
        "shared_experts": sparse_layers * 3 * h * moe_inter * cfg.get("n_shared_experts", 0),
        "routed_experts": sparse_layers * e * 3 * h * moe_inter,
        "router": sparse_layers * (e * h + e),
        "norms": layers * 2 * h + h,
    }
    return out


def active_parameters(cfg: dict) -> int:
    p = parameters(cfg)
    routed_active = p["routed_experts"] * cfg["num_experts_per_tok"] // cfg["n_routed_experts"]
    return sum(p.values()) - p["routed_experts"] + routed_active


def weight_bytes(cfg: dict, scheme: str) -> float:
    p = parameters(cfg)
    linear = ("attention", "dense_mlp", "shared_experts", "routed_experts", "head")
    if scheme == "bf16":
        return 2.0 * sum(p.values())
    if scheme == "fp8":
        lin = sum(p[k] for k in linear)
        return lin * (1 + 4 / (128 * 128)) + 2.0 * (sum(p.values()) - lin)
    if scheme == "int4":
        return p["routed_experts"] * 4.5 / 8 + 2.0 * (sum(p.values()) - p["routed_experts"])
    if scheme == "int4-all":
        lin = sum(p[k] for k in ("attention", "dense_mlp", "shared_experts", "routed_experts"))
        return lin * 4.5 / 8 + 2.0 * (sum(p.values()) - lin)
    raise ValueError(f"unknown scheme {scheme!r}; expected bf16, fp8, int4 or int4-all")


def kv_bytes_per_token(cfg: dict, dtype: str) -> dict[str, float]:
    """{'values': per token over all layers, 'bytes': with dtype (and fp8's scales)}."""
    layers = cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:
        per_layer = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        scales = 1                                     # one scale per token per layer for the latent row
    else:
        per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
        scales = 2 * cfg["num_key_value_heads"]         # K and V: one scale per token per kv head
    size = {"bf16": 2, "fp8": 1}[dtype]
    extra = 4 * scales if dtype == "fp8" else 0
    return {"values": per_layer * layers, "bytes": float(layers * (per_layer * size + extra))}


def expanded_kv_bytes_per_token(cfg: dict) -> float:
    """MLA served as per-head K/V (what an engine without a latent cache stores), bf16."""
    heads = cfg["num_attention_heads"]
    per_layer = heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) + heads * cfg["v_head_dim"]
    return 2.0 * per_layer * cfg["num_hidden_layers"]


def sizing(gpus: int = 8, gpu_gb: float = 141.0, reserve: float = 0.08) -> dict:
    hbm = gpus * gpu_gb * 1e9
    usable = hbm * (1 - reserve)
    out: dict = {"node": {"gpus": gpus, "gpu_gb": gpu_gb, "hbm_gb": hbm / 1e9, "reserve": reserve,
                          "usable_gb": usable / 1e9}, "models": {}}
    for name, cfg in MODELS.items():
        p = parameters(cfg)
        m: dict = {"total_parameters_b": sum(p.values()) / 1e9, "active_parameters_b": active_parameters(cfg) / 1e9,
                   "parameters_b": {k: v / 1e9 for k, v in p.items()}, "weights_gb": {}, "kv_per_token_kb": {},
                   "max_sequences": {}}
        for scheme in ("bf16", "fp8", "int4", "int4-all"):
            m["weights_gb"][scheme] = weight_bytes(cfg, scheme) / 1e9
        for kv in ("bf16", "fp8"):
            m["kv_per_token_kb"][kv] = kv_bytes_per_token(cfg, kv)["bytes"] / 1e3
        if "kv_lora_rank" in cfg:
            m["kv_per_token_kb"]["expanded_bf16"] = expanded_kv_bytes_per_token(cfg) / 1e3
        for scheme in ("fp8", "int4"):
            free = usable - weight_bytes(cfg, scheme)
            for kv in ("bf16", "fp8"):
                per_tok = kv_bytes_per_token(cfg, kv)["bytes"]
                for ctx in (32768, 131072):
                    key = f"weights {scheme}, kv {kv}, {ctx // 1024}k"
                    m["max_sequences"][key] = max(0, int(free // (per_tok * ctx)))
        out["models"][name] = m
    return out


# One H200 and its NVLink (stated assumptions, not measurements): HBM3e bandwidth, NVLink 4 per direction, dense
# bf16 tensor throughput at a sustained 50 % of the 989 TFLOP/s peak (INT4 weights are widened to bf16 for the dot)
H200_HBM_BPS = 4.8e12
NVLINK_BPS = 450e9
H200_BF16_FLOPS = 0.5 * 989e12
ALL_REDUCE_LATENCY_S = 15e-6    # one small all-reduce over 8 GPUs on NVLink
KERNEL_FLOOR_S = 3e-6           # one kernel's fixed cost inside a CUDA graph
KERNELS_PER_LAYER = 12


def decode_projection(cfg: dict, gpus: int = 8, batch: int = 1, context: int = 8192, kv_dtype: str = "fp8") -> dict:
    """Decode tok/s of one node for Kimi K2 with INT4 experts, as edgeinfer splits it: attention heads over `gpus`
    (tensor parallel; the MLA latent is shared by the heads, so every rank keeps every sequence's latent rows),
    routed experts by rank (expert parallel), dense layers / shared experts / vocab tensor-parallel. Per step and
    GPU: the weights it reads (its attention share, the distinct experts the batch touches among its own, its share
    of the rest), the KV it reads, and the bytes its collectives move (a ring all-reduce of the hidden state after
    attention and after each MLP: 2 (N-1)/N of the bf16 activations). The step takes the HBM time plus the link time
    (no overlap: the conservative sum); the compute time is reported beside it."""
    p = parameters(cfg)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    sparse = layers - cfg.get("first_k_dense_replace", 0)
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    per_expert = p["routed_experts"] / (sparse * e)
    touched = e * (1 - (1 - k / e) ** batch)                      # expected distinct experts a layer uses
    expert_bytes = sparse * touched / gpus * per_expert * 4.5 / 8
    rest = (p["attention"] + p["dense_mlp"] + p["shared_experts"]) * 2 / gpus + (p["head"] * 2) / gpus
    kv = kv_bytes_per_token(cfg, kv_dtype)["bytes"] * context * batch
    hbm_bytes = expert_bytes + rest + kv
    link_bytes = 2 * layers * batch * h * 2 * 2 * (gpus - 1) / gpus
    flops = 2 * active_parameters(cfg) * batch / gpus
    t_hbm, t_link, t_flop = hbm_bytes / H200_HBM_BPS, link_bytes / NVLINK_BPS, flops / H200_BF16_FLOPS
    t_fixed = layers * (2 * ALL_REDUCE_LATENCY_S + KERNELS_PER_LAYER * KERNEL_FLOOR_S)
    t = max(t_hbm + t_link + t_fixed, t_flop)
    terms = {"weights": (expert_bytes + rest) / H200_HBM_BPS, "kv": kv / H200_HBM_BPS, "collectives": t_link,
             "compute": t_flop, "fixed latency": t_fixed}
    return {"batch": batch, "context": context, "expert_gb": expert_bytes / 1e9, "other_weight_gb": rest / 1e9,
            "kv_gb": kv / 1e9, "link_gb": link_bytes / 1e9, "t_hbm_ms": t_hbm * 1e3, "t_link_ms": t_link * 1e3,
            "t_fixed_ms": t_fixed * 1e3, "t_compute_ms": t_flop * 1e3, "step_ms": t * 1e3, "tok_s": batch / t,
            "bound_by": max(terms, key=terms.get)}


def markdown(s: dict) -> str:
    n = s["node"]
    lines = [f"{n['gpus']} x {n['gpu_gb']:.0f} GB = {n['hbm_gb']:.0f} GB HBM; {n['usable_gb']:.0f} GB for weights "
             f"and KV after a {n['reserve']:.0%} reserve.", ""]
    for name, m in s["models"].items():
        w, kv = m["weights_gb"], m["kv_per_token_kb"]
        lines += [f"**{name}**: {m['total_parameters_b']:.0f}B parameters, {m['active_parameters_b']:.1f}B active "
                  f"per token.", "",
                  "| weights | bf16 | fp8 | int4 (experts) | int4 (all linears) |", "|---|---|---|---|---|",
                  f"| GB | {w['bf16']:.0f} | {w['fp8']:.0f} | {w['int4']:.0f} | {w['int4-all']:.0f} |", "",
                  "| KV per token | " + " | ".join(kv) + " |", "|---|" + "---|" * len(kv),
                  "| KB | " + " | ".join(f"{v:.1f}" for v in kv.values()) + " |", "",
                  "| sequences that fit | 32k | 128k |", "|---|---|---|"]
        for scheme in ("fp8", "int4"):
            for kvd in ("bf16", "fp8"):
                a = m["max_sequences"][f"weights {scheme}, kv {kvd}, 32k"]
                b = m["max_sequences"][f"weights {scheme}, kv {kvd}, 128k"]
                lines.append(f"| weights {scheme}, KV {kvd} | {a} | {b} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-gb", type=float, default=141.0)
    ap.add_argument("--reserve", type=float, default=0.08)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sizing.json")
    a = ap.parse_args(argv)
    s = sizing(a.gpus, a.gpu_gb, a.reserve)
    s["kimi_k2_decode_projection"] = [decode_projection(KIMI_K2, a.gpus, b, 8192) for b in (1, 64, 256)]
    print(markdown(s))
    print("Kimi K2, INT4 experts, fp8 latent KV, 8k context, 8 x H200 (projection):")
    print("| sequences | expert GB | other weights GB | KV GB | link GB | HBM ms | link ms | fixed ms | compute ms | "
          "step ms | tok/s | bound by |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in s["kimi_k2_decode_projection"]:
        print(f"| {r['batch']} | {r['expert_gb']:.2f} | {r['other_weight_gb']:.2f} | {r['kv_gb']:.2f} | "
              f"{r['link_gb']:.3f} | {r['t_hbm_ms']:.2f} | {r['t_link_ms']:.3f} | {r['t_fixed_ms']:.2f} | "
              f"{r['t_compute_ms']:.2f} | {r['step_ms']:.2f} | {r['tok_s']:.0f} | {r['bound_by']} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(s, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
