"""Reading a checkpoint directory and assembling the paged decoder from it: safetensors files (dense, or an
edgeinfer / AWQ / GPTQ INT4 checkpoint through backend/model/quant_loader.py), the layers of every supported
architecture (dense, MoE, MLA), row permutations, then prepack on CPU (load_model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from edgeinfer.backend.model.decoder import DecoderModel
from edgeinfer.backend.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from edgeinfer.backend.model.linear import (
    DenseLinear,
    Q8Embedding,
    W4A16Linear,
    cpu_prepack_enabled,
)
from edgeinfer.backend.model.mla import MLAAttention, interleave_to_halves
from edgeinfer.backend.model.model_config import CheckpointError, ModelConfig
from edgeinfer.backend.model.moe import DenseExperts, Int4Experts, SparseMoE
from edgeinfer.backend.model.mtp import MTP_TENSORS, MTPLayer
from edgeinfer.backend.model.packing import group_dequantize_mins
from edgeinfer.backend.model.quant_loader import q8_embedding, quantized_linear_factory
from edgeinfer.kernels.w4a16_gemm import group_dequantize_tensor


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed safetensors index ({e})") from e
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: names shard {f.name!r}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(path):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    # a copy: get_tensor's tensors view the file's mapping, which then stays mapped (and its
                    # pages in this process's RSS: the whole 92 MB of the default model) for as long as any
                    # of them lives, though prepack replaces most of them
                    tensors[name] = fh.get_tensor(name).clone()
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({type(e).__name__}: {e})") from e
    return tensors


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                make_linear=None, source: str = "", fuse_gate_up: bool | None = None,
                prepack: bool = False, mtp: bool = False) -> DecoderModel:
    """Assemble the model; `make_linear(prefix_list, tensors) -> nn.Module` builds (fused) linears;
    `prepack` packs dense linears for oneDNN where the device and dtype allow it; `mtp` also builds the checkpoint's
    multi-token-prediction layer (model.mtp; CheckpointError where it has none)."""

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"{source}: missing tensor {name!r}")
        return tensors[name]

    def check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=dtype)

    def dense(names: list[str], shapes: list[tuple[int, int]], bias: bool = False) -> nn.Module:
        ws = [check(n + ".weight", take(n + ".weight"), s) for n, s in zip(names, shapes)]
        bs = [check(n + ".bias", take(n + ".bias"), (s[0],)) for n, s in zip(names, shapes)] if bias else None
        return DenseLinear(torch.cat(ws).contiguous(), torch.cat(bs) if bs else None)

    if fuse_gate_up is None:          # split only for plain-layout dense GEMMs (two were faster on CPU)
        fuse_gate_up = make_linear is not None or prepack
    make_linear = make_linear or dense
    h, c = cfg.hidden_size, cfg

    def mlp(p: str, inter: int) -> MLP:   # p: "model.layers.i.mlp." (or its shared_experts.)
        shape = (inter, h)
        if fuse_gate_up:
            gate_up = make_linear([p + "gate_proj", p + "up_proj"], [shape, shape])
        else:
            gate_up = (make_linear([p + "gate_proj"], [shape]), make_linear([p + "up_proj"], [shape]))
        return MLP(gate_up, make_linear([p + "down_proj"], [(h, inter)]))

    def norm(name: str, size: int) -> RMSNorm:
        return RMSNorm(check(name, take(name), (size,)), cfg.rms_norm_eps)

    def decoder_layer(i: int, sparse: bool) -> DecoderLayer:
        p = f"model.layers.{i}."
        attn: Attention | MLAAttention
        if cfg.mla is not None:
            attn = _mla_attention(cfg, p + "self_attn.", tensors, take, norm, make_linear, dtype, device, source)
        else:
            qkv = make_linear([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
                              [(c.q_size, h), (c.kv_size, h), (c.kv_size, h)], bias=cfg.attention_bias)
            o = make_linear([p + "self_attn.o_proj"], [(h, c.q_size)])
            qk_norms = ((norm(p + "self_attn.q_norm.weight", c.head_dim),
                         norm(p + "self_attn.k_norm.weight", c.head_dim)) if cfg.qk_norm else (None, None))
            attn = Attention(cfg, qkv, o, *qk_norms)
        ffn: MLP | SparseMoE
        if sparse:
            ffn = _sparse_moe(cfg, p + "mlp.", tensors, take, mlp, make_linear, dtype, device, source)
        else:
            ffn = mlp(p + "mlp.", c.intermediate_size)
        return DecoderLayer(attn, ffn, norm(p + "input_layernorm.weight", h),
                            norm(p + "post_attention_layernorm.weight", h))

    layers = [decoder_layer(i, cfg.moe is not None and cfg.moe.sparse_layers[i]) for i in range(cfg.num_layers)]
    embed: torch.Tensor | Q8Embedding
    if "model.embed_tokens.weight" not in tensors and "model.embed_tokens.qweight" in tensors:

        embed = q8_embedding(tensors, (cfg.vocab_size, h), dtype, device, source)
    else:
        embed = check("model.embed_tokens.weight", take("model.embed_tokens.weight"), (cfg.vocab_size, h))
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = check("lm_head.weight", take("lm_head.weight"), (cfg.vocab_size, h))
    final_norm = RMSNorm(check("model.norm.weight", take("model.norm.weight"), (h,)), cfg.rms_norm_eps)
    model = DecoderModel(cfg, embed, layers, final_norm, lm_head, device).eval()
    if mtp:
        model.mtp = _mtp_layer(cfg, tensors, decoder_layer, make_linear, check, source)
    if prepack:
        model.prepack()
    return model


def _mtp_layer(cfg: ModelConfig, tensors: dict[str, torch.Tensor], decoder_layer, make_linear, check,
               source: str) -> MTPLayer:
    """The first MTP layer, `model.layers.<num_hidden_layers>.`: enorm, hnorm, eh_proj [H, 2H], the decoder block
    (attention + the MoE of a sparse layer), shared_head.norm and, if stored, shared_head.head (else the lm_head)."""
    if cfg.num_nextn_predict_layers < 1:
        raise CheckpointError(f"{source}: num_nextn_predict_layers={cfg.num_nextn_predict_layers}: this checkpoint "
                              "has no MTP layer (speculative 'mtp' needs one; use 'ngram' or 'off')")
    i, h = cfg.num_layers, cfg.hidden_size
    p = f"model.layers.{i}."
    missing = [p + n for n in MTP_TENSORS if p + n not in tensors and p + n.replace(".weight", ".qweight") not in tensors]
    if missing:
        raise CheckpointError(f"{source}: num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the MTP tensors "
                              f"are missing, e.g. {missing[0]!r} (a converter that drops them?)")
    sparse = cfg.moe is not None and cfg.moe.sparse_layers[-1]   # DeepSeek-V3 / GLM-4.5: sparse past the dense head
    block = decoder_layer(i, sparse)

    def rms(name: str) -> RMSNorm:
        return RMSNorm(check(name, tensors[name], (h,)), cfg.rms_norm_eps)

    eh_proj = make_linear([p + "eh_proj"], [(h, 2 * h)])
    head_name = p + "shared_head.head.weight"
    head = DenseLinear(check(head_name, tensors[head_name], (cfg.vocab_size, h))) if head_name in tensors else None
    return MTPLayer(rms(p + "enorm.weight"), rms(p + "hnorm.weight"), eh_proj, block, rms(p + "shared_head.norm.weight"),
                    head)


def _permute_rows(tensors: dict[str, torch.Tensor], prefix: str, perm: torch.Tensor, source: str) -> None:
    """Reorder dim 0 of every row-indexed tensor of the linear at prefix (weight, bias, or a quantized layout's
    qweight / scales / zeros / mins / weight_packed / weight_scale): rows are independent in all of them."""
    n = perm.numel()
    found = False
    for name in [k for k in tensors if k.startswith(prefix + ".")]:
        t = tensors[name]
        if t.dim() >= 1 and t.shape[0] == n and not name.endswith("weight_shape"):
            tensors[name] = t.index_select(0, perm)
            found = True
    if not found:
        raise CheckpointError(f"{source}: no tensor with {n} rows under {prefix!r} to reorder for rope")


def _mla_attention(cfg: ModelConfig, p: str, tensors: dict[str, torch.Tensor], take, norm, make_linear,
                   dtype: torch.dtype, device: torch.device, source: str) -> MLAAttention:
    """DeepSeek-V3 attention at prefix p ("model.layers.i.self_attn."): q_a_proj, q_a_layernorm, q_b_proj (or
    q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj (kept dense: decode folds it into the query and the
    output), o_proj. Interleaved rope rows are reordered to rotate-half layout here (backend/model/mla.py)."""
    m = cfg.mla
    assert m is not None
    h, heads = cfg.hidden_size, cfg.num_heads
    q_rows = heads * m.qk_head_dim
    q_name = p + ("q_b_proj" if m.q_lora_rank else "q_proj")
    if m.rope_interleave:
        halves = interleave_to_halves(m.qk_rope_head_dim)
        per_head = torch.cat((torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + halves))
        _permute_rows(tensors, q_name, (torch.arange(heads)[:, None] * m.qk_head_dim + per_head).reshape(-1), source)
        _permute_rows(tensors, p + "kv_a_proj_with_mqa",
                      torch.cat((torch.arange(m.kv_lora_rank), m.kv_lora_rank + halves)), source)
    if m.q_lora_rank:
        q_a = make_linear([p + "q_a_proj"], [(m.q_lora_rank, h)], bias=cfg.attention_bias)
        q_a_norm = norm(p + "q_a_layernorm.weight", m.q_lora_rank)
        q_b = make_linear([q_name], [(q_rows, m.q_lora_rank)])
    else:
        q_a = q_a_norm = None
        q_b = make_linear([q_name], [(q_rows, h)])
    kv_a = make_linear([p + "kv_a_proj_with_mqa"], [(m.latent_dim, h)], bias=cfg.attention_bias)
    kv_a_norm = norm(p + "kv_a_layernorm.weight", m.kv_lora_rank)
    kv_b_shape = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    kv_b_mod = make_linear([p + "kv_b_proj"], [kv_b_shape])
    kv_b = dense_weight(kv_b_mod).to(device=device, dtype=dtype)
    o = make_linear([p + "o_proj"], [(h, heads * m.v_head_dim)], bias=cfg.attention_bias)
    return MLAAttention(cfg, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o)


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """[out, in] of a DenseLinear or (dequantized) W4A16Linear that is not prepacked."""
    if isinstance(linear, DenseLinear) and linear.weight is not None:
        return linear.weight.data
    if isinstance(linear, W4A16Linear) and not linear.prepacked:

        if linear.mins is not None:
            return group_dequantize_mins(linear.qweight, linear.scales, linear.mins, linear.group_size)
        return group_dequantize_tensor(linear.qweight, linear.scales, linear.zeros, linear.group_size)
    raise TypeError(f"no plain weight in {type(linear).__name__} (prepacked?)")


def _sparse_moe(cfg: ModelConfig, p: str, tensors: dict[str, torch.Tensor], take, mlp, make_linear,
                dtype: torch.dtype, device: torch.device, source: str) -> SparseMoE:
    """The MoE block at prefix p ("model.layers.i.mlp."): router `gate.weight` [E, H] (kept fp32) and, for sigmoid
    routing, `gate.e_score_correction_bias` [E]; the routed experts per expert (`experts.<e>.{gate,up,down}_proj`,
    plain or quantized: INT4 ones become one Int4Experts) or fused (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]); `shared_experts.*` when n_shared_experts > 0."""
    moe = cfg.moe
    assert moe is not None
    h, e, inter = cfg.hidden_size, moe.num_experts, moe.intermediate_size

    def fp32(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = take(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=torch.float32)

    router = fp32(p + "gate.weight", (e, h))
    bias = fp32(p + "gate.e_score_correction_bias", (e,)) if moe.scoring == "sigmoid" else None
    experts: DenseExperts | Int4Experts
    if p + "experts.gate_up_proj" in tensors:
        gate_up = take(p + "experts.gate_up_proj")
        down = take(p + "experts.down_proj")
        if tuple(gate_up.shape) != (e, 2 * inter, h) or tuple(down.shape) != (e, h, inter):
            raise CheckpointError(f"{source}: {p}experts gate_up_proj {tuple(gate_up.shape)} / down_proj "
                                  f"{tuple(down.shape)}: expected {(e, 2 * inter, h)} / {(e, h, inter)}")
        experts = DenseExperts(gate_up.to(device=device, dtype=dtype), down.to(device=device, dtype=dtype))
    else:
        ep = [f"{p}experts.{j}." for j in range(e)]
        gu = [make_linear([q + "gate_proj", q + "up_proj"], [(inter, h), (inter, h)]) for q in ep]
        dn = [make_linear([q + "down_proj"], [(h, inter)]) for q in ep]
        if all(isinstance(m, W4A16Linear) for m in gu + dn):
            experts = Int4Experts.from_linears(gu, dn)
        elif all(isinstance(m, DenseLinear) for m in gu + dn):
            experts = DenseExperts(torch.stack([m.weight for m in gu]), torch.stack([m.weight for m in dn]))
        else:
            raise CheckpointError(f"{source}: {p}experts mix INT4 and unquantized experts; expected all or none")
    shared = mlp(p + "shared_experts.", moe.n_shared_experts * inter) if moe.n_shared_experts else None
    return SparseMoE(moe, router, experts, shared, bias)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               fuse_gate_up: bool | None = None, prepack: bool | None = None, mtp: bool = False) -> DecoderModel:
    """prepack=None: pack dense linears for oneDNN on CPU unless EDGEINFER_CPU_PREPACK=0. Code that
    reads or rewrites weights (the quantizer) passes prepack=False."""
    path = Path(path)
    if prepack is None:
        prepack = torch.device(device).type == "cpu" and cpu_prepack_enabled()
    cfg = ModelConfig.from_dir(path)
    tensors = read_tensors(path)
    make_linear = None
    if cfg.quantization is not None:

        make_linear = quantized_linear_factory(cfg, tensors, dtype, torch.device(device), source=str(path))
    return build_model(cfg, tensors, dtype, torch.device(device), make_linear, source=str(path),
                       fuse_gate_up=fuse_gate_up, prepack=prepack, mtp=mtp)
