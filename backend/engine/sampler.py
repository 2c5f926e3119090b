"""Per-request sampling: greedy, temperature, top-k/top-p/min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import torch

from backend.engine.sequence import Sequence
from backend.protocol import TokenLogprob


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    sp = seq.sampling
    if sp.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seq.all_ids)), dtype=torch.long)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and seq.output_ids:
        counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum - sorted_logits.softmax(-1) >= top_p    # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    return logits


def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
    # logits: [len(seqs), vocab] float32
    out: list[tuple[int, TokenLogprob | None]] = []
    plain_greedy = [i for i, s in enumerate(seqs) if s.sampling.temperature == 0 and not _has_penalty(s)]
    if len(plain_greedy) == len(seqs):
        greedy_ids = logits.argmax(-1).tolist()
    elif plain_greedy:   # index_select: advanced indexing of [n, vocab] rows costs ~3 ms on CPU
        greedy_ids = logits.index_select(0, torch.tensor(plain_greedy)).argmax(-1).tolist()
    else:
        greedy_ids = []
    greedy = dict(zip(plain_greedy, greedy_ids))
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        raw = logits[i]
        if i in greedy:
            tok = greedy[i]
        else:
            row = _apply_penalties(raw.clone(), seq) if _has_penalty(seq) else raw
            if sp.temperature == 0:
                tok = int(row.argmax())
            else:
                row = _filter(row / sp.temperature, sp.top_k, sp.top_p, sp.min_p)
                probs = row.softmax(-1)
                tok = int(torch.multinomial(probs, 1, generator=seq.generator))
        lp = None
        if sp.logprobs:
            logp = raw.log_softmax(-1)
            top = []
            if sp.top_logprobs:
                v, ix = logp.topk(sp.top_logprobs)
                top = list(zip(ix.tolist(), v.tolist()))
            lp = TokenLogprob(tok, float(logp[tok]), top)
        out.append((tok, lp))
    return out


def _has_penalty(seq: Sequence) -> bool:
    sp = seq.sampling
    return sp.repetition_penalty != 1.0 or bool(sp.presence_penalty) or bool(sp.frequency_penalty)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g
