"""Model config from an HF `config.json`: the dense Llama / Mistral / Qwen2 families and the Mixture-of-Experts
Qwen3-MoE and GLM-4.5/4.6 families (field names as the transformers config classes write them)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class Architecture:
    """What an architecture name in config.json means to the one paged decoder: its registry entry (every
    per-architecture decision of the config parser is here, none in from_dict)."""
    name: str
    routing: str | None = None          # MoE: "softmax" (Qwen3-MoE) or "sigmoid" (grouped, GLM-4.5 / DeepSeek-V3)
    mla: bool = False                   # Multi-head Latent Attention (DeepSeek-V3, Kimi K2)
    qkv_bias: bool = False              # attention_bias when config.json leaves it out (Qwen2)
    qk_norm: bool = False               # QK-norm whatever config.json says (Qwen3-MoE); else its use_qk_norm
    sliding_window: bool = False        # use_sliding_window when config.json leaves it out (Mistral)

    @property
    def moe(self) -> bool:
        return self.routing is not None


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM"),
    Architecture("MistralForCausalLM", sliding_window=True),
    Architecture("Qwen2ForCausalLM", qkv_bias=True),
    Architecture("Qwen3MoeForCausalLM", routing="softmax", qk_norm=True),
    Architecture("Glm4MoeForCausalLM", routing="sigmoid"),
    Architecture("DeepseekV3ForCausalLM", routing="sigmoid", mla=True),
)}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
MOE_ARCHITECTURES = tuple(a.name for a in ARCHITECTURES.values() if a.moe)
UNSUPPORTED_MLA = ("DeepseekV2ForCausalLM",)   # MLA with V2's softmax greedy-group routing: not implemented


@dataclass(frozen=True)
class MoEConfig:
    """The routed-expert layer (backend/model/moe.py). Qwen3-MoE: softmax over all experts, top-k, optionally
    renormalized. GLM-4.5 / DeepSeek-V3: sigmoid scores, `e_score_correction_bias` added for the choice only,
    the top-k taken inside the `topk_group` best of `n_group` groups (a group scores the sum of its two best),
    the chosen sigmoid scores renormalized (norm_topk_prob) and scaled by routed_scaling_factor; shared experts."""
    num_experts: int
    top_k: int
    intermediate_size: int            # each routed expert's (moe_intermediate_size)
    scoring: str                      # softmax | sigmoid
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]   # per decoder layer: True = MoE, False = the dense MLP (intermediate_size)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0         # one shared MLP of n_shared_experts * intermediate_size


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V3, Kimi K2: backend/model/mla.py). The KV cache holds, per token and
    layer, one row of kv_lora_rank latent values then qk_rope_head_dim rope-key values (576 for Kimi K2)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None     # None: one q_proj [heads * (nope + rope), hidden]
    rope_interleave: bool = True       # rope on (x0, x1), (x2, x3), ... pairs (the checkpoints' layout)
    softmax_scale: float = 1.0         # (nope + rope) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: dict | None = None
    qk_norm: bool = False             # RMSNorm over each q and k head before rope (Qwen3, GLM-4.5 use_qk_norm)
    rotary_dim: int = 0               # rope on the first rotary_dim of each head (partial_rotary_factor); 0 = all
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None      # set: num_kv_heads = 1 and head_dim = the latent row (the KV pool's shape)
    num_nextn_predict_layers: int = 0 # MTP layers after the decoder layers (DeepSeek-V3, GLM-4.5: backend/model/mtp.py)
    source: str = field(default="", compare=False)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_path = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(f"{path}: checkpoint directory does not exist")
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: missing config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: malformed JSON ({e})") from e
        return cls.from_dict(raw, source=str(cfg_path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in UNSUPPORTED_MLA:
            raise CheckpointError(f"{source}: architecture {arch!r} is unsupported (DeepSeek-V2's routing); "
                                  "DeepseekV3ForCausalLM (DeepSeek-V3, Kimi K2) is supported")
        spec = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
        if spec is None:
            raise CheckpointError(f"{source}: unsupported architecture {arch!r}; supported: "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")

        def need(key: str):
            if key not in raw:
                raise CheckpointError(f"{source}: missing required key {key!r}")
            v = raw[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise CheckpointError(f"{source}: {key}={v!r} is invalid: expected a positive integer")
            return v

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                  f"num_key_value_heads={kv_heads}")
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"{source}: hidden_act={act!r} is unsupported; expected 'silu'")
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta", 10000.0)
        params = raw.get("rope_parameters")     # transformers >= 5 layout: theta + scaling in one dict
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", params.get("type", "default")) != "default":
                rope_scaling = params
        if rope_scaling is not None:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise CheckpointError(f"{source}: unsupported rope type {rtype!r}; supported: "
                                      f"{', '.join(SUPPORTED_ROPE_TYPES)}")
            rope_scaling = {**rope_scaling, "rope_type": rtype}
        sliding = raw.get("sliding_window")
        max_pos = raw.get("max_position_embeddings", 2048)
        if sliding and raw.get("use_sliding_window", spec.sliding_window) and sliding < max_pos:
            raise CheckpointError(f"{source}: sliding_window={sliding} < max_position_embeddings={max_pos} "
                                  "is unsupported (full attention only)")
        mla = _mla_config(raw, need, rope_scaling, source) if spec.mla else None
        head_dim = raw.get("head_dim") or hidden // heads
        if mla is not None:   # the cache's view: one latent row per token, rope on its qk_rope_head_dim part
            kv_heads, head_dim = 1, mla.latent_dim
        partial = raw.get("partial_rotary_factor", 1.0)
        if isinstance(params, dict):
            partial = params.get("partial_rotary_factor", partial)
        rotary_dim = mla.qk_rope_head_dim if mla is not None else int(head_dim * float(partial))
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise CheckpointError(f"{source}: partial_rotary_factor={partial!r} gives a rotary dim of {rotary_dim}; "
                                  f"expected an even number in (0, head_dim={head_dim}]")
        moe = _moe_config(spec, raw, need, source) if spec.moe else None
        nextn = raw.get("num_nextn_predict_layers", 0) or 0
        if not isinstance(nextn, int) or isinstance(nextn, bool) or nextn < 0:
            raise CheckpointError(f"{source}: num_nextn_predict_layers={nextn!r} is invalid: expected an integer >= 0")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=spec.name,
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", spec.qkv_bias)),
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            quantization=raw.get("quantization_config"),
            qk_norm=spec.qk_norm or bool(raw.get("use_qk_norm", False)),
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            moe=moe,
            mla=mla,
            num_nextn_predict_layers=nextn,
            source=source,
        )


def _moe_config(spec: Architecture, raw: dict, need, source: str) -> MoEConfig:
    layers = need("num_hidden_layers")
    experts = raw.get("num_experts", raw.get("num_local_experts", raw.get("n_routed_experts")))
    if not isinstance(experts, int) or isinstance(experts, bool) or experts <= 0:
        raise CheckpointError(f"{source}: num_experts={experts!r} is invalid: expected a positive integer "
                              "(num_experts, num_local_experts or n_routed_experts)")
    top_k = need("num_experts_per_tok")
    if top_k > experts:
        raise CheckpointError(f"{source}: num_experts_per_tok={top_k} > num_experts={experts}")
    inter = need("moe_intermediate_size")
    if spec.routing == "softmax":
        step = raw.get("decoder_sparse_step", 1) or 1
        dense_only = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        return MoEConfig(experts, top_k, inter, "softmax", bool(raw.get("norm_topk_prob", False)), sparse)
    first_dense = raw.get("first_k_dense_replace", 0) or 0
    n_group, topk_group = raw.get("n_group", 1) or 1, raw.get("topk_group", 1) or 1
    if experts % n_group or not 0 < topk_group <= n_group:
        raise CheckpointError(f"{source}: n_group={n_group}, topk_group={topk_group} do not divide "
                              f"num_experts={experts} into groups (need n_group | num_experts, topk_group <= n_group)")
    if topk_group * (experts // n_group) < top_k:
        raise CheckpointError(f"{source}: topk_group={topk_group} groups of {experts // n_group} experts hold fewer "
                              f"than num_experts_per_tok={top_k}")
    sparse = tuple(i >= first_dense for i in range(layers))
    return MoEConfig(experts, top_k, inter, "sigmoid", bool(raw.get("norm_topk_prob", True)), sparse,
                     n_group=n_group, topk_group=topk_group,
                     routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                     n_shared_experts=int(raw.get("n_shared_experts", 0) or 0))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _mla_config(raw: dict, need, rope_scaling: dict | None, source: str) -> MLAConfig:
    q_rank = raw.get("q_lora_rank")
    if q_rank is not None and (not isinstance(q_rank, int) or isinstance(q_rank, bool) or q_rank <= 0):
        raise CheckpointError(f"{source}: q_lora_rank={q_rank!r} is invalid: expected a positive integer or null")
    nope, rope = need("qk_nope_head_dim"), need("qk_rope_head_dim")
    if rope % 2:
        raise CheckpointError(f"{source}: qk_rope_head_dim={rope} is invalid: expected an even number")
    scale = (nope + rope) ** -0.5
    if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn" and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(rope_scaling.get("factor", 1.0)), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    return MLAConfig(kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                     v_head_dim=need("v_head_dim"), q_lora_rank=q_rank,
                     rope_interleave=bool(raw.get("rope_interleave", True)), softmax_scale=scale)


def rope_inv_freq(cfg: ModelConfig) -> tuple[list[float], float]:
    """Inverse frequencies after rope scaling, and the attention scaling factor (yarn mscale)."""
    d = cfg.rope_dim
    base = [1.0 / (cfg.rope_theta ** (2 * i / d)) for i in range(d // 2)]
    rs = cfg.rope_scaling
    if rs is None or rs["rope_type"] == "default":
        return base, 1.0
    t = rs["rope_type"]
    factor = float(rs.get("factor", 1.0))
    if t == "linear":
        return [f / factor for f in base], 1.0
    if t == "llama3":
        lo, hi = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old = float(rs.get("original_max_position_embeddings", 8192))
        lo_wl, hi_wl = old / lo, old / hi
        out = []
        for f in base:
            wl = 2 * math.pi / f
            if wl < hi_wl:
                out.append(f)
            elif wl > lo_wl:
                out.append(f / factor)
            else:
                s = (old / wl - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        return out, 1.0
    # yarn
    old = float(rs.get("original_max_position_embeddings", cfg.max_position_embeddings))
    beta_fast, beta_slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))

    def corr_dim(rot: float) -> float:
        return (d * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high: float = min(math.ceil(corr_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(base):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrap = 1 - ramp
        out.append(f / factor * (1 - extrap) + f * extrap)
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:   # transformers' rule: DeepSeek's mscale / mscale_all_dim ratio where both are set
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all)) if m and m_all
                            else yarn_mscale(factor))
    return out, float(attention_factor)
