"""A Mixture-of-Experts router's top-k, as transformers computes it (one function for the model's path,
backend/model/moe.py route(), and the decode loop's reference, kernels/cpu/attn_reference.py decode_layers; the C++
loop, kernels/cpu/attn.cpp route(), calls the same ATen ops in the same order).

  route_topk(logits [T, E], k, sigmoid, n_group, topk_group, norm_topk, scaling, bias [E] | None)
      -> (weights [T, k] fp32, ids [T, k] int64)

softmax (Qwen3-MoE): top-k of softmax(logits); with norm_topk the k weights are renormalized to sum 1.
sigmoid (GLM-4.5, DeepSeek-V3): s = sigmoid(logits); the choice ranks s + bias, restricted to the topk_group groups
(of n_group) whose two best biased scores sum highest; the weights are the chosen experts' unbiased s, renormalized
(norm_topk) and multiplied by scaling. The bias moves only the choice, never a weight.
"""

from __future__ import annotations

import torch


def route_topk(logits: torch.Tensor, k: int, sigmoid: bool, n_group: int, topk_group: int, norm_topk: bool,
               scaling: float, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if not sigmoid:
        weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        if norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        t, e = choice.shape
        per = e // n_group
        group_scores = choice.view(t, n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
        keep = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
