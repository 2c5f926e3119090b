"""Per-request sampling: greedy, temperature, top-k/top-p/min-p, penalties, seeds, logprobs.

Numerically safe for every value SamplingParams.validate admits (a NaN would make torch.multinomial
raise and, before isolation, fail every sequence of the step):
- temperature below GREEDY_BELOW samples greedily (as vLLM does below its 1e-5), and the scaled logits
  are computed as (logits - max) / temperature, which is <= 0 everywhere and 0 at the top token: no
  overflow to +inf at any admitted temperature; temperatures above HOTTEST (1e30) act as 1e30;
- penalized logits are clamped to the finite float32 range (a repetition_penalty of 1e-40 or 1e40
  saturates instead of reaching +-inf; saturated tokens tie);
- every filter keeps the top token (top_p=1e-46 rounds to 0 in float32 and used to keep nothing).
A row that still cannot be sampled (NaN logits from the model) raises SamplingError for that sequence
only; `sample` returns it in that sequence's place.
"""

from __future__ import annotations

import torch

from edgeinfer.backend.engine.grammar import GrammarCompiler, apply_masks
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.protocol.wire import SamplingParams, TokenLogprob

GREEDY_BELOW = 1e-5
HOTTEST = 1e30      # a larger temperature would be inf in float32 (and -inf / inf is NaN)
_F32_MAX = torch.finfo(torch.float32).max

Sampled = tuple[int, TokenLogprob | None]


class SamplingError(RuntimeError):
    """One sequence's token could not be sampled; the other sequences of the step are unaffected."""

    code = 500      # this request failed on a healthy node: the gateway does not retry it


class GrammarFailed(SamplingError):
    """The request's own grammar failed while decoding (a parser limit: Earley items, lexer fuel, ...): the
    request's fault, reported as 422 so the gateway answers 400 naming the constraint (docs/GATEWAY.md)."""

    code = 422


def grammar_failed(seq: Sequence, error: str) -> GrammarFailed:
    return GrammarFailed(f"the request's grammar failed at output token {len(seq.output_ids)}: {error.strip()}; "
                         "simplify the schema, regex or choices")


def is_greedy(sp: SamplingParams) -> bool:
    return sp.temperature < GREEDY_BELOW


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
    return logits.clamp_(-_F32_MAX, _F32_MAX)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Each filter keeps at least the top token."""
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
        remove[0] = False                                     # top_p rounded to 0 in float32 keeps the top token
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    return logits


def check_row(raw: torch.Tensor, seq: Sequence) -> None:
    """-inf marks an impossible token; NaN, +inf or nothing finite cannot be sampled."""
    if bool(torch.isfinite(raw).all()):
        return
    if bool(torch.isnan(raw).any()) or bool(torch.isposinf(raw).any()) or not bool(torch.isfinite(raw).any()):
        raise SamplingError(f"request {seq.request_id}: the model produced non-finite logits "
                            f"(NaN, +inf or all -inf over {raw.shape[0]} tokens)")


def _sample_one(seq: Sequence, raw: torch.Tensor) -> int:
    sp = seq.sampling
    check_row(raw, seq)
    row = raw
    if _has_penalty(seq):
        row = _apply_penalties(raw.clone(), seq)
        if not bool(torch.isfinite(raw).all()):        # clamping made impossible tokens possible again
            row.masked_fill_(torch.isneginf(raw), float("-inf"))
    if is_greedy(sp):
        return int(row.argmax())
    scaled = (row - row.max()) / min(sp.temperature, HOTTEST)   # in [-inf, 0], 0 at the top token: no NaN
    probs = filter_logits(scaled, sp.top_k, sp.top_p, sp.min_p).softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        raise SamplingError(f"request {seq.request_id}: probabilities are not finite (temperature="
                            f"{sp.temperature}, top_p={sp.top_p}, top_k={sp.top_k}, min_p={sp.min_p}, "
                            f"repetition_penalty={sp.repetition_penalty})")
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def _logprob(seq: Sequence, raw: torch.Tensor, tok: int) -> TokenLogprob | None:
    sp = seq.sampling
    if not sp.logprobs:
        return None
    logp = raw.log_softmax(-1)
    top = []
    if sp.top_logprobs:
        v, ix = logp.topk(sp.top_logprobs)
        top = list(zip(ix.tolist(), v.tolist()))
    return TokenLogprob(tok, float(logp[tok]), top)


def sample(seqs: list[Sequence], logits: torch.Tensor, grammars: GrammarCompiler | None = None
           ) -> list[Sampled | SamplingError]:
    """One (token, logprob) per sequence, or the SamplingError that ended that sequence alone.
    logits: [len(seqs), vocab] float32. The rows of constrained sequences are masked first, all at once."""
    out: list[Sampled | SamplingError] = []
    biased = [(i, s.sampling.logit_bias) for i, s in enumerate(seqs) if s.sampling.logit_bias]
    if biased:   # the logits are an inference tensor: updated in place only in the mode
        with torch.inference_mode():
            for i, bias in biased:
                _add_bias(logits[i], bias)
    constrained = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
    if constrained:
        assert grammars is not None, "a constrained sequence needs the engine's GrammarCompiler"
        apply_masks(grammars, constrained, logits)   # type: ignore[arg-type]
    plain_greedy = [i for i, s in enumerate(seqs) if is_greedy(s.sampling) and not _has_penalty(s)]
    if len(plain_greedy) == len(seqs):
        greedy_ids = logits.argmax(-1).tolist()
    elif plain_greedy:   # index_select: advanced indexing of [n, vocab] rows costs ~3 ms on CPU
        greedy_ids = logits.index_select(0, torch.tensor(plain_greedy)).argmax(-1).tolist()
    else:
        greedy_ids = []
    greedy = dict(zip(plain_greedy, greedy_ids))
    odd = _nonfinite_picks(logits, plain_greedy, greedy_ids)
    for i, seq in enumerate(seqs):
        raw = logits[i]
        try:
            if seq.matcher is not None and seq.matcher.is_error():
                raise grammar_failed(seq, seq.matcher.get_error())
            if i in greedy:
                tok = greedy[i]
                if i in odd:
                    check_row(raw, seq)
            else:
                tok = _sample_one(seq, raw)
            out.append((tok, _logprob(seq, raw, tok)))
        except Exception as e:  # any failure is this sequence's alone
            out.append(e if isinstance(e, SamplingError) else
                       SamplingError(f"request {seq.request_id}: sampling failed: {type(e).__name__}: {e}"))
    return out


def _add_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    """OpenAI's logit_bias on one row, before the grammar mask (a masked token stays -inf whatever its bias);
    ids past the model's vocabulary are ignored (the gateway refuses ids past the tokenizer's)."""
    vocab = row.shape[0]
    ids = [t for t in bias if t < vocab]
    if ids:
        row.index_add_(0, torch.tensor(ids, device=row.device),
                       torch.tensor([bias[t] for t in ids], dtype=row.dtype, device=row.device))


def _nonfinite_picks(logits: torch.Tensor, rows: list[int], ids: list[int]) -> set[int]:
    """Rows whose argmax is not finite: argmax lands on a NaN or +inf when the row has one."""
    if not rows:
        return set()
    picked = logits[torch.tensor(rows), torch.tensor(ids)]
    return {rows[j] for j in (~torch.isfinite(picked)).nonzero().flatten().tolist()}


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
