"""A GGUF file's metadata as a Hugging Face checkpoint's: config.json (every supported architecture's fields,
rope scaling, MoE and MLA sizes) and the tokenizer files (BPE vocab, merges, added tokens, chat template)."""

from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURES = {"llama": "LlamaForCausalLM", "glm4moe": "Glm4MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "deepseek2": "DeepseekV3ForCausalLM"}


class ModelImportError(RuntimeError):
    pass


def gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_config(reader, path: Path, names: set[str]) -> dict:
    arch = gguf_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelImportError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                               f"{', '.join(repr(a) for a in ARCHITECTURES)}")
    p = f"{arch}."
    nextn = int(gguf_field(reader, p + "nextn_predict_layers", 0) or 0)
    heads = int(gguf_field(reader, p + "attention.head_count"))
    hidden = int(gguf_field(reader, p + "embedding_length"))
    vocab = gguf_field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = int(gguf_field(reader, p + "attention.key_length", 0) or gguf_field(reader, p + "rope.dimension_count",
                                                                          hidden // heads))
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": {"llama": "llama", "glm4moe": "glm4_moe", "qwen3moe": "qwen3_moe",
                       "deepseek2": "deepseek_v3"}[arch],
        "hidden_size": hidden,
        "intermediate_size": int(gguf_field(reader, p + "feed_forward_length", 0)),
        # llama.cpp's glm4moe conversion appends the MTP ("NextN") layers as blocks: block_count counts them
        "num_hidden_layers": int(gguf_field(reader, p + "block_count")) - nextn,
        "num_nextn_predict_layers": nextn,
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(gguf_field(reader, p + "context_length", 2048)),
        "rms_norm_eps": float(gguf_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(gguf_field(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(gguf_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(gguf_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float32",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    if arch != "llama":
        rope_dim = int(gguf_field(reader, p + "rope.dimension_count", head_dim))
        cfg |= {
            "num_experts_per_tok": int(gguf_field(reader, p + "expert_used_count")),
            "moe_intermediate_size": int(gguf_field(reader, p + "expert_feed_forward_length")),
            "norm_topk_prob": bool(gguf_field(reader, p + "expert_weights_norm", True)),
            "partial_rotary_factor": rope_dim / head_dim,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
        }
    if arch == "deepseek2":
        rope = int(gguf_field(reader, p + "rope.dimension_count"))
        q_rank = int(gguf_field(reader, p + "attention.q_lora_rank", 0) or 0)
        cfg |= {
            "num_key_value_heads": heads, "head_dim": rope, "qk_rope_head_dim": rope,
            "kv_lora_rank": int(gguf_field(reader, p + "attention.kv_lora_rank")),
            "qk_nope_head_dim": int(gguf_field(reader, p + "attention.key_length_mla")) - rope,
            "v_head_dim": int(gguf_field(reader, p + "attention.value_length_mla")),
            "q_lora_rank": q_rank or None, "rope_interleave": True, "partial_rotary_factor": 1.0,
        }
        cfg.pop("use_qk_norm")
        scaling = gguf_field(reader, p + "rope.scaling.type")
        if scaling not in (None, "none", "yarn"):
            raise ModelImportError(f"{path}: deepseek2 rope.scaling.type={scaling!r}; supported: none, yarn")
        if scaling == "yarn":
            log_mul = float(gguf_field(reader, p + "rope.scaling.yarn_log_multiplier", 0.0))
            cfg["rope_scaling"] = {   # llama.cpp writes 0.1 * mscale_all_dim; DeepSeek-V3 has mscale = mscale_all_dim
                "rope_type": "yarn", "factor": float(gguf_field(reader, p + "rope.scaling.factor")),
                "original_max_position_embeddings": int(gguf_field(reader, p + "rope.scaling.original_context_length")),
                "mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1, "beta_fast": 32.0, "beta_slow": 1.0}
    if arch in ("glm4moe", "deepseek2"):
        gating = int(gguf_field(reader, p + "expert_gating_func", 2))
        if gating != 2:
            raise ModelImportError(f"{path}: {arch}.expert_gating_func={gating}; expected 2 (sigmoid, "
                                   "DeepSeek-V3 / GLM-4.5 routing)")
        cfg |= {
            "n_routed_experts": int(gguf_field(reader, p + "expert_count")),
            "n_shared_experts": int(gguf_field(reader, p + "expert_shared_count", 0)),
            "first_k_dense_replace": int(gguf_field(reader, p + "leading_dense_block_count", 0)),
            "routed_scaling_factor": float(gguf_field(reader, p + "expert_weights_scale", 1.0)),
            "n_group": int(gguf_field(reader, p + "expert_group_count", 1) or 1),
            "topk_group": int(gguf_field(reader, p + "expert_group_used_count", 1) or 1),
        }
    elif arch == "qwen3moe":
        cfg |= {"num_experts": int(gguf_field(reader, p + "expert_count")), "decoder_sparse_step": 1,
                "mlp_only_layers": [], "use_qk_norm": True}
    pad = gguf_field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        cfg["pad_token_id"] = int(pad)
    return cfg


def hf_tokenizer_files(reader, path: Path) -> tuple[dict, dict]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelImportError(f"{path}: unsupported tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)")
    tokens = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    types = list(gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "qwen2"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens(specials)

    def name(key: str) -> str | None:
        i = gguf_field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf_field(reader, "llama.context_length", 2048)),
    }
    tmpl = gguf_field(reader, "tokenizer.chat_template")
    if tmpl:
        tcfg["chat_template"] = tmpl
    return json.loads(tok.to_str()), tcfg
