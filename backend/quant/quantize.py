"""`edgeinfer model quantize SRC DST --scheme w4a16-g128 --method rtn|awq`.

Writes DST atomically (a temporary sibling directory renamed into place): model.safetensors with
`<hf prefix>.qweight/.scales/.zeros` per linear, the other tensors unchanged (AWQ edits RMSNorm weights),
tokenizer files copied, and config.json with an `edgeinfer-w4a16` quantization_config.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from edgeinfer.backend.model.atomic_dir import atomic_directory
from edgeinfer.backend.model.decoder import DecoderModel
from edgeinfer.backend.model.layers import MLP, Attention
from edgeinfer.backend.model.loader import dense_weight, load_model
from edgeinfer.backend.model.mla import MLAAttention
from edgeinfer.backend.model.model_config import CheckpointError, ModelConfig
from edgeinfer.backend.model.moe import DenseExperts, SparseMoE
from edgeinfer.backend.model.packing import effective_group_size, group_quantize_tensor
from edgeinfer.backend.model.quant_format import SCHEMES, edgeinfer_config
from edgeinfer.backend.quant.awq import GRID, apply_awq, collect_stats
from edgeinfer.backend.quant.calib import calibration_sources, interleaved_chunks
from edgeinfer.backend.quant.gptq import gptq_quantize
from edgeinfer.protocol.tokenizer import Tokenizer

log = logging.getLogger("edgeinfer.quant")
METHODS = ("rtn", "awq", "gptq", "awq-gptq")
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


class QuantizeError(ValueError):
    pass


def parse_scheme(scheme: str) -> int:
    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}; supported: {', '.join(SCHEMES)}")
    return SCHEMES[scheme]


def _weights(cfg: ModelConfig, layer, i: int) -> dict[str, tuple[Any, Any, list[tuple[str, int]]]]:
    """Each fused linear of layer i -> (weight [out, in], bias, [(hf prefix, rows)] in concatenation order). A MoE
    layer's routed experts are one gate_up and one down per expert (`experts.<e>.gate_up`), its shared experts
    gate_up/down as a dense MLP's."""
    p = f"model.layers.{i}."
    attn, mlp = layer.self_attn, layer.mlp
    out: dict[str, tuple[Any, Any, list[tuple[str, int]]]] = {}   # (weight, bias | None, parts)
    if isinstance(attn, Attention):   # MLA attention stays dense (_kept), as Kimi-K2-Thinking ships it
        out["qkv"] = (attn.qkv_proj.weight, attn.qkv_proj.bias,
                      [(p + "self_attn.q_proj", cfg.q_size), (p + "self_attn.k_proj", cfg.kv_size),
                       (p + "self_attn.v_proj", cfg.kv_size)])
        out["o"] = (attn.o_proj.weight, attn.o_proj.bias, [(p + "self_attn.o_proj", cfg.hidden_size)])

    def dense_mlp(m: MLP, prefix: str, inter: int) -> None:
        assert m.gate_up_proj is not None, "quantize loads the model with fuse_gate_up=True"
        out["gate_up"] = (m.gate_up_proj.weight, None, [(prefix + "gate_proj", inter), (prefix + "up_proj", inter)])
        out["down"] = (m.down_proj.weight, None, [(prefix + "down_proj", cfg.hidden_size)])

    if isinstance(mlp, MLP):
        dense_mlp(mlp, p + "mlp.", cfg.intermediate_size)
        return out
    if not isinstance(mlp.experts, DenseExperts):
        raise QuantizeError(f"layer {i}: the experts are already quantized; quantize an unquantized model")
    inter = mlp.moe.intermediate_size
    if mlp.shared_experts is not None:
        dense_mlp(mlp.shared_experts, p + "mlp.shared_experts.", mlp.moe.n_shared_experts * inter)
    for e in range(mlp.experts.num_experts):
        q = f"{p}mlp.experts.{e}."
        out[f"experts.{e}.gate_up"] = (mlp.experts.gate_up[e], None, [(q + "gate_proj", inter), (q + "up_proj", inter)])
        out[f"experts.{e}.down"] = (mlp.experts.down[e], None, [(q + "down_proj", cfg.hidden_size)])
    return out


def _kept(layer, i: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors that stay as they are: the norms and, in a MoE layer, the router (fp32) and its bias."""
    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": layer.input_layernorm.weight.data.clone(),
           p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight.data.clone()}
    attn = layer.self_attn
    if isinstance(attn, MLAAttention):
        mods = {"q_a_proj": attn.q_a_proj, "q_b_proj" if attn.q_a_proj is not None else "q_proj": attn.q_b_proj,
                "kv_a_proj_with_mqa": attn.kv_a_proj, "o_proj": attn.o_proj}
        for name, mod in mods.items():
            if mod is not None:
                out[p + f"self_attn.{name}.weight"] = dense_weight(mod).clone()
                bias: Any = getattr(mod, "bias", None)
                if bias is not None:
                    out[p + f"self_attn.{name}.bias"] = bias.data.clone()
        for name, norm in (("q_a_layernorm", attn.q_a_layernorm), ("kv_a_layernorm", attn.kv_a_layernorm)):
            weight: Any = getattr(norm, "weight", None)
            if weight is not None:
                out[p + f"self_attn.{name}.weight"] = weight.data.clone()
        out[p + "self_attn.kv_b_proj.weight"] = torch.cat((attn.w_uk, attn.w_uv), 1).reshape(
            -1, attn.mla.kv_lora_rank).clone()
    elif attn.q_norm is not None and attn.k_norm is not None:
        out[p + "self_attn.q_norm.weight"] = attn.q_norm.weight.data.clone()
        out[p + "self_attn.k_norm.weight"] = attn.k_norm.weight.data.clone()
    if isinstance(layer.mlp, SparseMoE):
        out[p + "mlp.gate.weight"] = layer.mlp.router.data.clone()
        if layer.mlp.correction_bias is not None:
            out[p + "mlp.gate.e_score_correction_bias"] = layer.mlp.correction_bias.data.clone()
    return out


def quantized_tensors(model: DecoderModel, group_size: int, clips: dict[str, torch.Tensor] | None = None,
                      hessians: dict[str, torch.Tensor] | None = None, progress: bool = True
                      ) -> dict[str, torch.Tensor]:
    """Per fused module: round to nearest (optionally clipped), or GPTQ rounding where a Hessian is given."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(tqdm(model.layers, desc="quantize", unit="layer", disable=not progress)):
        for key, (weight, b, parts) in _weights(cfg, layer, i).items():
            w = weight.data.float()
            g = effective_group_size(w.shape[1], group_size)
            clip = clips.get(f"{i}.{key}") if clips else None
            fused = gptq_quantize(w, hessians[f"{i}.{key}"], g, clip) if hessians else None
            row = 0
            for name, rows in parts:
                sl = slice(row, row + rows)
                if fused is not None:
                    q, s, z = fused[0][sl], fused[1][sl], fused[2][sl]
                else:
                    q, s, z = group_quantize_tensor(w[sl], g, clip=None if clip is None else clip[sl])
                out[name + ".qweight"], out[name + ".scales"], out[name + ".zeros"] = q, s, z
                if b is not None:
                    out[name + ".bias"] = b.data[sl].clone()
                row += rows
        out |= _kept(layer, i)
    embed = model.embed_tokens
    if not isinstance(embed, torch.Tensor):
        raise QuantizeError("the model's embedding is already quantized (a GGUF native import): quantize a dense one")
    out["model.embed_tokens.weight"] = embed.data.clone()
    out["model.norm.weight"] = model.norm.weight.data.clone()
    if not cfg.tie_word_embeddings:
        if model.lm_head is None:
            raise QuantizeError("the model's lm_head is prepacked: load it with prepack=False to quantize it")
        out["lm_head.weight"] = model.lm_head.data.clone()
    return {k: v.contiguous() for k, v in out.items()}


def calibration_chunks(src: Path, num: int, length: int, which: str = "mix") -> tuple[list[list[int]], str]:
    tok = Tokenizer.from_dir(src)
    try:
        sources = calibration_sources(which)
    except ValueError as e:
        raise QuantizeError(str(e)) from e
    ids = [tok.encode(text) for text, _ in sources]
    chunks = interleaved_chunks(ids, num, length)
    name = " + ".join(n for (_, n), t in zip(sources, ids) if len(t) >= length)
    if not chunks:
        raise QuantizeError(f"calibration text {name or sources[0][1]} has fewer tokens than one chunk of {length}")
    return chunks, name


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str = "w4a16-g128", method: str = "awq",
                        calib_chunks: int = 32, calib_len: int = 512, progress: bool = True,
                        calibration: str = "mix", skip_first: int = 0, awq_grid: int | None = None) -> Path:
    src, dst = Path(src), Path(dst)
    group_size = parse_scheme(scheme)
    if method not in METHODS:
        raise QuantizeError(f"unknown method {method!r}; supported: {', '.join(METHODS)}")
    cfg = ModelConfig.from_dir(src)
    if cfg.quantization is not None:
        raise QuantizeError(f"{src}/config.json already has a quantization_config; quantize an unquantized model")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise QuantizeError(f"{dst}: destination exists and is not an empty directory")
    if cfg.moe is not None and method != "rtn":
        raise QuantizeError(f"method {method!r} calibrates dense MLPs only; {cfg.architecture} is a Mixture-of-Experts "
                            "model: quantize it with --method rtn (its experts are rounded to nearest per group)")
    torch.manual_seed(0)
    model = load_model(src, torch.float32, "cpu", fuse_gate_up=True, prepack=False)   # AWQ/GPTQ work on fused gate_up
    extra: dict = {"scheme": scheme}
    clips = hessians = None
    if method != "rtn":
        chunks, calib_name = calibration_chunks(src, calib_chunks, calib_len, calibration)
        t0 = time.time()
        stats = collect_stats(model, chunks, skip_first=skip_first)
        if method in ("awq", "awq-gptq"):
            clips = apply_awq(model, stats, group_size, grid=awq_grid or GRID)   # also rescales each H to the folded weights
        if method in ("gptq", "awq-gptq"):
            hessians = {f"{i}.{n}": s.h for i, st in enumerate(stats) for n, s in st.inputs.items()}
        extra["calibration"] = {"source": calib_name, "sequences": len(chunks), "tokens_per_sequence": calib_len,
                                "skip_first": skip_first, "seconds": round(time.time() - t0, 1)}
    tensors = quantized_tensors(model, group_size, clips, hessians, progress)

    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = edgeinfer_config(group_size, method, **extra)
    if cfg.mla is not None:   # the loader reordered the rope rows to rotate-half layout: what is written is that
        raw["rope_interleave"] = False
    with atomic_directory(dst) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "quantized_from": src.name})
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        for f in COPY_FILES:
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)
    return dst


def main(args) -> int:
    try:
        out = quantize_checkpoint(args.src, args.dst, args.scheme, args.method,
                                  calibration=getattr(args, "calibration", "mix"))
    except (QuantizeError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}")
        return 2
    print(f"wrote {out} ({args.scheme}, {args.method})")
    return 0
