"""Verification of a draft against the target model's logits (exact greedy acceptance; rejection sampling for
sampled requests): the rules in backend/engine/spec/policy.py's docstring."""

from __future__ import annotations

import torch

from edgeinfer.backend.engine.sampler import (
    GREEDY_BELOW,
    HOTTEST,
    SamplingError,
    check_row,
    filter_logits,
    is_greedy,
)
from edgeinfer.backend.engine.sequence import Sequence


def verify(seq: Sequence, draft: list[int], rows: torch.Tensor) -> tuple[list[int], int]:
    """(tokens to emit, how many draft tokens were accepted) from the verify chunk's logits rows [k+1, vocab].
    Raises SamplingError for a row that cannot be sampled (that sequence alone ends)."""
    sp = seq.sampling
    out: list[int] = []
    if is_greedy(sp):
        picks = rows.argmax(-1).tolist()
        for i, d in enumerate(draft):
            if picks[i] != d:
                check_row(rows[i], seq)
                return [*out, picks[i]], i
            out.append(d)
        check_row(rows[len(draft)], seq)
        return [*out, picks[len(draft)]], len(draft)
    for i, d in enumerate(draft):
        probs = target_probs(seq, rows[i])
        p = float(probs[d])
        if p > 0 and float(torch.rand((), generator=seq.generator)) < p:
            out.append(d)
            continue
        probs[d] = 0.0
        total = float(probs.sum())
        if total <= 0:           # p(d) was 1 up to rounding: d is the only possible token
            out.append(d)
            continue
        return [*out, int(torch.multinomial(probs / total, 1, generator=seq.generator))], i
    probs = target_probs(seq, rows[len(draft)])
    return [*out, int(torch.multinomial(probs, 1, generator=seq.generator))], len(draft)


def target_probs(seq: Sequence, raw: torch.Tensor) -> torch.Tensor:
    """The target distribution sampler._sample_one draws from (no penalties: eligible() excludes them)."""
    sp = seq.sampling
    check_row(raw, seq)
    assert sp.temperature >= GREEDY_BELOW
    scaled = (raw - raw.max()) / min(sp.temperature, HOTTEST)
    probs = filter_logits(scaled, sp.top_k, sp.top_p, sp.min_p).softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        raise SamplingError(f"request {seq.request_id}: probabilities are not finite (temperature={sp.temperature})")
    return probs.clone()
