"""Tiny random Mixture-of-Experts checkpoints built with transformers' own config and model classes (the oracle):
Qwen3-MoE, GLM-4.5 (Glm4Moe) and DeepSeek-V3, a few layers of 16 experts, top-4, 2 groups.

Random init leaves the routers near-uniform and the correction bias at zero, which would let a routing bug hide:
the router weights are scaled up, every `e_score_correction_bias` is drawn large enough to move the top-k choice,
and the 2-D weights are sharpened so greedy decoding is not a coin toss.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.hf_compat import hide_hub_kernels

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


# llama.cpp's tensor names (its convert_hf_to_gguf.py) per decoder layer: glm4moe, and deepseek2 on top
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GGUF_MLA_LAYER = {
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
}


def write_moe_gguf(hf, path: Path, tokenizer_gguf: Path, quant: str = "Q4_0", mtp: dict | None = None) -> Path:
    """The GLM-4.5 or DeepSeek-V3 model `hf` as llama.cpp's converter lays it out (arch glm4moe or deepseek2: expert
    tensors [E, N, K], no q/k permutation, DeepSeek's kv_b_proj split into k_b (transposed per head) and v_b), its
    2-D decoder linears and expert tensors in `quant` (Q4_0, Q4_1 or F32), everything else F32; the tokenizer
    fields copied from `tokenizer_gguf` (whose vocabulary the model must have). `mtp` (build_mtp's tensors): the MTP
    layer appended as llama.cpp's glm4moe conversion does it (one more block, its own tensors as `blk.N.nextn.*`,
    `nextn_predict_layers` = 1)."""
    import gguf
    import numpy as np

    c = hf.config
    mla = c.model_type == "deepseek_v3"
    arch = "deepseek2" if mla else "glm4moe"
    src = gguf.GGUFReader(str(tokenizer_gguf))
    w = gguf.GGUFWriter(str(path), arch)
    a = arch + "."
    blocks = c.num_hidden_layers + (1 if mtp else 0)
    meta = {"block_count": blocks, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads,
            "expert_count": c.n_routed_experts, "expert_used_count": c.num_experts_per_tok,
            "expert_group_count": c.n_group, "expert_group_used_count": c.topk_group,
            "expert_feed_forward_length": c.moe_intermediate_size, "expert_shared_count": c.n_shared_experts,
            "leading_dense_block_count": c.first_k_dense_replace, "expert_gating_func": 2, "vocab_size": c.vocab_size}
    if mla:
        meta |= {"attention.head_count_kv": 1, "attention.key_length": c.kv_lora_rank + c.qk_rope_head_dim,
                 "attention.value_length": c.kv_lora_rank, "attention.kv_lora_rank": c.kv_lora_rank,
                 "attention.key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim,
                 "attention.value_length_mla": c.v_head_dim, "rope.dimension_count": c.qk_rope_head_dim}
        if c.q_lora_rank:
            meta["attention.q_lora_rank"] = c.q_lora_rank
    else:
        meta |= {"attention.head_count_kv": c.num_key_value_heads, "attention.key_length": c.head_dim,
                 "attention.value_length": c.head_dim,
                 "rope.dimension_count": int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))}
    if mtp:
        meta["nextn_predict_layers"] = 1
    for key, value in meta.items():
        w.add_uint32(a + key, int(value))
    w.add_float32(a + "rope.freq_base", float(c.rope_parameters["rope_theta"]))
    w.add_float32(a + "attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
    w.add_float32(a + "expert_weights_scale", float(c.routed_scaling_factor))
    w.add_bool(a + "expert_weights_norm", bool(c.norm_topk_prob))
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                w.add_array(key, list(field.contents()))
            elif kind == gguf.GGUFValueType.STRING:
                w.add_string(key, field.contents())
            elif kind == gguf.GGUFValueType.BOOL:
                w.add_bool(key, bool(field.contents()))
            else:
                w.add_uint32(key, int(field.contents()))
    kind = gguf.GGMLQuantizationType[quant]

    def add(name: str, t: torch.Tensor, linear: bool) -> None:
        arr = t.detach().float().numpy()
        if linear and quant != "F32" and arr.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=gguf.GGMLQuantizationType.F32)

    sd = hf.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"], False)
    add("output_norm.weight", sd["model.norm.weight"], False)
    add("output.weight", sd["lm_head.weight"], False)
    names = _GGUF_LAYER | (_GGUF_MLA_LAYER if mla else {})
    nextn = {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
             "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight",
             "shared_head.head.weight": "nextn.shared_head_head.weight"}
    for hf_name, g_name in nextn.items():
        if mtp:
            add(f"blk.{c.num_hidden_layers}.{g_name}", mtp[f"model.layers.{c.num_hidden_layers}.{hf_name}"],
                hf_name == "eh_proj.weight")
    for i in range(blocks):
        p = f"model.layers.{i}."
        for hf_name, g_name in names.items():
            if p + hf_name in sd:
                add(f"blk.{i}.{g_name}", sd[p + hf_name], hf_name.endswith(("_proj.weight", "_mqa.weight")))
        if mla:   # kv_b_proj [H * (nope + v), r] -> k_b [H, r, nope] (transposed per head), v_b [H, v, r];
            # quantized like the linears where their rows are whole blocks, as llama-quantize does
            kv_b = sd[p + "self_attn.kv_b_proj.weight"].view(c.num_attention_heads, -1, c.kv_lora_rank)
            add(f"blk.{i}.attn_k_b.weight", kv_b[:, : c.qk_nope_head_dim].transpose(1, 2).contiguous(), True)
            add(f"blk.{i}.attn_v_b.weight", kv_b[:, c.qk_nope_head_dim:].contiguous(), True)
        if p + "mlp.experts.gate_up_proj" in sd:
            gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
            inter = gate_up.shape[1] // 2
            add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :inter], True)
            add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, inter:], True)
            add(f"blk.{i}.ffn_down_exps.weight", down, True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def compressed_tensors_experts(src: Path, dst: Path, group_size: int = 32) -> dict:
    """Copy the checkpoint at src to dst with every routed expert's linears quantized as Kimi-K2-Thinking ships
    them: compressed-tensors `pack-quantized`, symmetric int4 groups, made by the compressed-tensors library's own
    quantize and pack_to_int32; the rest (attention, shared experts, dense MLPs, head) left dense, as its `ignore`
    list says. Returns {expert weight name: the library's own dequantization} (the oracle)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    hide_hub_kernels()
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    tensors = load_file(str(src / "model.safetensors"))
    out, oracle = {}, {}
    for name, w in tensors.items():
        if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
            out[name] = w
            continue
        n, k = w.shape
        grouped = w.float().reshape(n, k // group_size, group_size)
        scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        q = quantize(w.float(), scale, zp, args, dtype=torch.int8)
        prefix = name.removesuffix(".weight")
        out[prefix + ".weight_packed"] = pack_to_int32(q, 4)
        out[prefix + ".weight_scale"] = scale.to(torch.bfloat16)
        out[prefix + ".weight_shape"] = torch.tensor([n, k])
        unpacked = unpack_from_int32(out[prefix + ".weight_packed"], 4, torch.Size([n, k]))
        assert torch.equal(unpacked, q)
        oracle[name] = dequantize(unpacked, out[prefix + ".weight_scale"].float(), zp, args).float()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": group_size,
                                                  "dynamic": False, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, dst / f)
    return oracle


def servable_llama(out: Path, tokenizer_dir: Path, **overrides):
    """A tiny random Llama (8 heads, 2 KV heads: splits over 2 ranks) with the tokenizer at tokenizer_dir."""
    import json
    import shutil

    hide_hub_kernels()
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
              vocab_size=vocab, max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(LlamaConfig(**(kw | overrides))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    return model


def build_mtp(kind: str, out: Path, seed: int = 0, echo: float = 0.0, layers: int = 3, **overrides):
    """A tiny GLM-4.5 or DeepSeek-V3 checkpoint with its MTP layer, laid out as the published checkpoints ship it:
    `num_hidden_layers` = `layers` (3) decoder layers, then `model.layers.3.*` = the MTP block (a decoder layer made
    by transformers' own class: the 4th layer of a 4-layer model, so it is sparse as DeepSeek's layer 61 is) plus
    enorm, hnorm, eh_proj [H, 2H], shared_head.norm and shared_head.head; config.json says num_nextn_predict_layers=1.

    `echo` > 0 makes the MTP layer a fair predictor on this random model: eh_proj passes hnorm(h) through, the
    block's output projections are scaled by 1 - echo, the shared head is the lm_head and norm; its logits at i are
    then close to the model's own at i, so the draft for the token after t is t again, which the sharpened tiny
    models, prone to repeat a token, often accept (the accept path gets exercised; with echo=0 it is random).

    Returns (model, mtp): the transformers model holding all 4 layers with config.num_hidden_layers set to 3 (its
    forward runs the main model; model.model.layers[3] is the MTP block), and the MTP layer's own tensors."""
    import json

    from safetensors.torch import save_file

    model = build(kind, None, seed=seed, num_hidden_layers=layers + 1, **overrides)
    c = model.config
    h, v = c.hidden_size, c.vocab_size
    g = torch.Generator().manual_seed(seed + 7)
    sd = {k: t.detach().clone().contiguous() for k, t in model.state_dict().items()}
    p = f"model.layers.{layers}."
    mtp = {p + "enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
           p + "hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
           p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 3 / (2 * h) ** 0.5,
           p + "shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
           p + "shared_head.head.weight": torch.randn(v, h, generator=g) * 3 / h ** 0.5}
    if echo:
        mtp[p + "enorm.weight"] = torch.ones(h)
        mtp[p + "hnorm.weight"] = torch.ones(h)
        mtp[p + "eh_proj.weight"] = torch.cat((torch.zeros(h, h), torch.eye(h)), 1)
        mtp[p + "shared_head.norm.weight"] = sd["model.norm.weight"].clone()
        mtp[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
        for k in sd:
            if k.startswith(p) and k.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                sd[k] = sd[k] * (1 - echo)
        model.load_state_dict(sd)
    model.config.num_hidden_layers = layers
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd | mtp, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = c.to_dict() | {"num_hidden_layers": layers, "num_nextn_predict_layers": 1,
                         "architectures": [type(model).__name__]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return model, mtp


def mtp_reference_logits(model, mtp: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The MTP layer's logits at every position of `ids` but the last, recomputed from scratch in full precision with
    transformers' own decoder layer for the block (the DeepSeek-V3 report's MTP module, as vLLM and SGLang run it):
    row i pairs the main model's final (normed) hidden state at i with the embedding of ids[i + 1] and predicts
    ids[i + 2]."""
    from transformers.masking_utils import create_causal_mask

    L = model.config.num_hidden_layers
    p = f"model.layers.{L}."

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x64 = x.double()
        return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)).float() * w

    with torch.no_grad():
        t = torch.tensor([ids])
        hidden = model.model(input_ids=t).last_hidden_state[0, :-1]             # [n - 1, H]
        emb = model.model.embed_tokens(t[0, 1:])
        x = torch.cat((rms(emb, mtp[p + "enorm.weight"]), rms(hidden, mtp[p + "hnorm.weight"])), -1)
        x = (x @ mtp[p + "eh_proj.weight"].t())[None]
        pos = torch.arange(x.shape[1])[None]
        mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=pos)
        y = model.model.layers[L](x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=mask,
                                  position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return rms(y[0], mtp[p + "shared_head.norm.weight"]) @ mtp[p + "shared_head.head.weight"].t()
