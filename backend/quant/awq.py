"""Activation-aware INT4 (AWQ-style): per-input-channel scale search, then per-group clipping search.

For each linear, calibration inputs X give H = X^T X and mean|x| per channel. For alpha on a grid (step 1/GRID),
s = mean|x|^alpha / wmean^(1-alpha) (AutoAWQ's duo scaling; s = 1 is always a candidate) and
  loss(s) = trace(E H E^T),  E = W - Q(W diag(s)) diag(1/s)
is the output error over every calibration token. The best s is folded away exactly:
  qkv     <- input_layernorm.weight / s
  gate_up <- post_attention_layernorm.weight / s
  o_proj  <- v_proj rows / s (s tied across the query heads that share a kv head, so GQA stays exact)
  down    <- up_proj rows / s
Then each (row, group) clip ratio in [0.55, 1] minimizes the same error (q/k rows are not clipped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from tqdm import tqdm

from edgeinfer.backend.model.decoder import DecoderModel
from edgeinfer.backend.model.packing import effective_group_size, fake_quantize
from edgeinfer.backend.quant.calib import paged_prefill

GRID = 20                                  # alpha in {0, 1/GRID, ..., 1}
CLIP_RATIOS = [1 - i / 20 for i in range(10)]


@dataclass
class InputStats:
    h: torch.Tensor                   # [K, K] sum of x x^T over tokens
    abs_sum: torch.Tensor             # [K]
    count: int = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.h.addmm_(x.t(), x)
        self.abs_sum += x.abs().sum(0)
        self.count += x.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)


@dataclass
class LayerStats:
    inputs: dict[str, InputStats] = field(default_factory=dict)


def _modules(layer) -> dict[str, torch.nn.Module]:
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
            "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}


@torch.inference_mode()
def collect_stats(model: DecoderModel, chunks: list[list[int]], batch: int = 2, skip_first: int = 0
                  ) -> list[LayerStats]:
    """Input statistics of every linear; the first skip_first tokens of each chunk (attention-sink
    positions with outlier activations) are left out."""
    stats = [LayerStats() for _ in model.layers]
    handles = []
    keep: list[torch.Tensor] = []
    for layer, st in zip(model.layers, stats):
        for name, mod in _modules(layer).items():
            k = cast(torch.Tensor, mod.weight).shape[1]
            st.inputs[name] = InputStats(torch.zeros(k, k), torch.zeros(k))

            def hook(_m, args, s=st.inputs[name]):
                s.add(args[0][keep[0]])
            handles.append(mod.register_forward_pre_hook(hook))
    try:
        for i in tqdm(range(0, len(chunks), batch), desc="calibration forward", unit="batch"):
            part = chunks[i:i + batch]
            keep[:] = [torch.cat([torch.arange(skip_first, len(c)) + sum(map(len, part[:j]))
                                  for j, c in enumerate(part)])]
            paged_prefill(model, part)
    finally:
        for h in handles:
            h.remove()
    return stats


def _loss(w: torch.Tensor, s: torch.Tensor, h: torch.Tensor, group: int) -> float:
    e = w - fake_quantize(w * s, group) / s
    return float(((e @ h) * e).sum())


def _wmean(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    g = w.abs().reshape(n, k // group, group)
    return (g / g.amax(-1, keepdim=True).clamp(min=1e-8)).reshape(n, k).mean(0)


def search_scale(w: torch.Tensor, st: InputStats, group: int, tie: tuple[int, int, int] | None = None,
                 grid: int = GRID) -> torch.Tensor:
    """-> s [K] minimizing the output error; tie=(kv_heads, group_q, head_dim) shares s within a GQA group."""
    x_mean, w_mean = st.mean_abs, _wmean(w, group)
    if tie is not None:
        kvh, gq, hd = tie
        x_mean = x_mean.view(kvh, gq, hd).mean(1, keepdim=True).expand(kvh, gq, hd).reshape(-1)
        w_mean = w_mean.view(kvh, gq, hd).mean(1, keepdim=True).expand(kvh, gq, hd).reshape(-1)
    best_s, best = torch.ones_like(x_mean), _loss(w, torch.ones_like(x_mean), st.h, group)
    for a in (i / grid for i in range(grid + 1)):
        s = (x_mean.clamp(min=1e-8).pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = _loss(w, s, st.h, group)
        if loss < best:
            best, best_s = loss, s
    return best_s


def search_clip(w: torch.Tensor, h: torch.Tensor, group: int, frozen_rows: int = 0) -> torch.Tensor:
    """-> clip [N, K//G] (abs max per group); rows [:frozen_rows] keep their full range."""
    n, k = w.shape
    ng = k // group
    hg = torch.stack([h[i * group:(i + 1) * group, i * group:(i + 1) * group] for i in range(ng)])  # [ng, G, G]
    amax = w.abs().reshape(n, ng, group).amax(-1)
    best_err = torch.full((n, ng), float("inf"))
    best_clip = amax.clone()
    for r in CLIP_RATIOS:
        clip = amax * r
        e = (w - fake_quantize(w, group, clip)).reshape(n, ng, group)
        err = torch.einsum("ngk,gkl,ngl->ng", e, hg, e)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_clip = torch.where(better, clip, best_clip)
    best_clip[:frozen_rows] = amax[:frozen_rows]
    return best_clip


@torch.inference_mode()
def apply_awq(model: DecoderModel, stats: list[LayerStats], group_size: int, grid: int = GRID
              ) -> dict[str, torch.Tensor]:
    """Fold the searched scales into the fp model in place; -> clip per fused module name."""
    c = model.cfg
    tie = (c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
    clips: dict[str, torch.Tensor] = {}
    for i, (layer, st) in enumerate(tqdm(list(zip(model.layers, stats)), desc="awq search", unit="layer")):
        mods = _modules(layer)
        # fp32 models: views, edited in place
        w = {n: cast(torch.Tensor, m.weight).data.float() for n, m in mods.items()}
        g = {n: effective_group_size(w[n].shape[1], group_size) for n in mods}

        s = search_scale(w["qkv"], st.inputs["qkv"], g["qkv"], grid=grid)
        layer.input_layernorm.weight.data /= s
        w["qkv"] *= s
        st.inputs["qkv"].h /= torch.outer(s, s)

        s = search_scale(w["o"], st.inputs["o"], g["o"], tie=tie, grid=grid)
        s_kv = s.view(tie)[:, 0, :].reshape(-1)
        v_rows = slice(c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)
        w["qkv"][v_rows] /= s_kv[:, None]
        if mods["qkv"].bias is not None:
            cast(torch.Tensor, mods["qkv"].bias).data[v_rows] /= s_kv
        w["o"] *= s
        st.inputs["o"].h /= torch.outer(s, s)

        s = search_scale(w["gate_up"], st.inputs["gate_up"], g["gate_up"], grid=grid)
        layer.post_attention_layernorm.weight.data /= s
        w["gate_up"] *= s
        st.inputs["gate_up"].h /= torch.outer(s, s)

        s = search_scale(w["down"], st.inputs["down"], g["down"], grid=grid)
        w["gate_up"][c.intermediate_size:] /= s[:, None]
        w["down"] *= s
        st.inputs["down"].h /= torch.outer(s, s)

        for n, m in mods.items():
            cast(torch.Tensor, m.weight).data.copy_(w[n])
            frozen = c.q_size + c.kv_size if n == "qkv" else 0
            clips[f"{i}.{n}"] = search_clip(w[n], st.inputs[n].h, g[n], frozen_rows=frozen)
    return clips
