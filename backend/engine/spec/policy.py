"""Speculative decoding: n-gram (prompt lookup) drafts verified in one forward pass, inside continuous batching.

A decoding sequence with a draft d1..dk is run as a verify chunk of k+1 tokens [last, d1, .., dk] at positions
n-1 .. n-1+k over its paged KV (the prefill path: causal inside the chunk, the cached context before it), with
logits at every position. Then, position by position, the target's token is compared with the draft:

- greedy: t_i = argmax(logits_i); d_{i+1} is accepted while t_i == d_{i+1}; the first mismatch emits t_i instead
  and ends the run; if every draft token is accepted the last row gives a bonus token. The output is exactly the
  non-speculative output: each emitted token is the argmax after exactly the tokens before it.
- sampling (temperature > 0, with top-k / top-p / min-p): rejection sampling (Leviathan et al. 2023, Chen et al.
  2023) with a deterministic draft (q = one-hot at d): accept d with probability p(d); on rejection sample from
  p with d removed, renormalized (the residual max(p - q, 0)). Each emitted token is distributed as p exactly.

Only the accepted tokens' KV counts (num_computed_tokens advances by 1 + accepted); the rejected positions' KV
stays in the slots past it and is overwritten by the next step. Pages are sealed (hashed, cached, published) by
num_computed_tokens only, so a rejected draft is never sealed into a page.

Drafts: `NgramDrafter` (no extra weights; vLLM's "ngram" / prompt lookup decoding): the longest suffix of the
sequence (prompt + output) of `max_ngram` .. `min_ngram` tokens that occurred before; the k tokens that followed
its latest earlier occurrence. Kept per sequence as a dict n-gram -> latest end position, updated as tokens
arrive, so a proposal costs O(max_ngram) dict lookups.

How many tokens to draft (`plan`, adaptive by default): a verify chunk's k+1 rows cost k more decode rows, which on
a CPU is most of a row's cost each (measured on the default model, 2 threads, batch 1: 6.8 ms for 1 row, 16.3 ms
for 5: a draft token costs ~1/3 of a step). So drafts are placed one token at a time where they pay: the j-th
draft token of a sequence whose tokens are accepted with probability a adds a^j expected tokens and one decode
row of time (the step-cost fit's per-row coefficient, backend/engine/step_cost.py); it is placed while
a^j / row_cost > expected tokens / step time, i.e. while it raises the step's tokens per second. A sequence's a
is estimated from its own verify steps (accepted and rejected draft tokens, decayed, prior 1/2). At batch 1 on
this CPU the first draft token needs a > ~0.34; at batch 32 the step is long but so is the token count, and a
draft needs a > ~0.9: copy-heavy sequences keep drafting, the rest stop. A sequence that has not verified for
`retry_every` steps gets one draft token to learn whether its text became predictable again.
Eligible: plain sampling only (no grammar, penalties, logit_bias or logprobs: each would need a per-position
state), and no seeded sampled request (a seed must give the same text twice, whatever the batch); `max_batch` caps the decoding sequences of a step above which nobody drafts.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from edgeinfer.backend.engine.sampler import is_greedy
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.backend.engine.spec.state import NgramIndex, SpecState

SPECULATIVE = ("ngram", "mtp", "off")


@dataclass(frozen=True)
class SpecPolicy:
    method: str = "ngram"          # ngram | mtp (the checkpoint's MTP layer: backend/model/mtp.py) | off
    num_tokens: int = 4            # the most draft tokens of one sequence in one verify step
    max_batch: int = 64            # decoding sequences in a step above which nobody drafts
    adaptive: bool = True          # place draft tokens where they pay (plan); False: every draft, whole
    min_ngram: int = 2
    max_ngram: int = 4
    retry_every: int = 32          # a sequence that has not verified for this many steps gets one draft token
    margin: float = 1.5            # a draft token must raise tokens/s by this factor over the step's rate (the
    #                                verify's own costs beyond its rows: measured in benchmarks/speculative.py)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE:
            raise ValueError(f"speculative={self.method!r} is invalid: expected one of {', '.join(SPECULATIVE)}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"spec_tokens={self.num_tokens!r} is invalid: expected 1..16")
        if self.max_batch < 0:
            raise ValueError(f"spec_max_batch={self.max_batch!r} is invalid: expected >= 0")
        if not self.margin > 0:
            raise ValueError(f"margin={self.margin!r} is invalid: expected > 0")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"min_ngram={self.min_ngram!r}, max_ngram={self.max_ngram!r}: expected 1 <= min <= max")


def eligible(seq: Sequence) -> bool:
    """Plain sampling only; and not a seeded sampled request: whether a step verifies a draft depends on the batch
    and the machine's step costs, and a verify draws its random numbers differently, so the same seed would not
    give the same text twice (greedy output does not depend on drafting)."""
    sp = seq.sampling
    return (seq.matcher is None and not sp.logprobs and not sp.logit_bias and sp.repetition_penalty == 1.0
            and not sp.presence_penalty and not sp.frequency_penalty and (sp.seed is None or is_greedy(sp)))


def state_of(seq: Sequence, policy: SpecPolicy) -> SpecState:
    if seq.spec is None:
        if policy.method == "ngram":
            seq.spec = SpecState(NgramIndex(policy.min_ngram, policy.max_ngram))
        else:   # mtp: prior 0.8 (DeepSeek-V3's MTP accepts 85-90 %, its report), then this sequence's own rate
            seq.spec = SpecState(None, accepted=1.6)
    return seq.spec


def plan(drafts: list[tuple[Sequence, list[int]]], policy: SpecPolicy, step: int, rows: int, prefill_tokens: int,
         coef: tuple[float, float, float] | None) -> list[int]:
    """How many tokens of each draft to verify (0: decode as usual). `rows`: the step's decode rows without drafts;
    `coef`: the step-cost fit (fixed, per decode row, per prefill token; None before one: a row costs 1, the fixed
    part 2 rows, a prefill token 1)."""
    if not policy.adaptive:
        return [len(d) for _, d in drafts]
    fixed, per_row, per_prefill = coef if coef is not None and coef[1] > 0 else (2.0, 1.0, 1.0)
    time = max(fixed, 0.0) + per_row * rows + max(per_prefill, 0.0) * prefill_tokens
    tokens = float(rows)
    ks = [0] * len(drafts)
    acceptance = [s.spec.acceptance if s.spec is not None else 0.5 for s, _ in drafts]
    heap: list[tuple[float, int]] = []
    for i, (seq, d) in enumerate(drafts):
        assert seq.spec is not None
        a = seq.spec.acceptance
        if step - seq.spec.last_verify >= policy.retry_every:
            ks[i] = 1                       # explore: one token, whatever its estimate
            tokens += a
            time += per_row
            if len(d) > 1:
                heapq.heappush(heap, (-a ** 2, i))
        else:
            heapq.heappush(heap, (-a, i))
    while heap:
        gain, i = heapq.heappop(heap)
        gain = -gain
        if gain * time <= policy.margin * per_row * tokens:    # not enough above the step's tokens per second
            break
        ks[i] += 1
        tokens += gain
        time += per_row
        if ks[i] < len(drafts[i][1]):
            heapq.heappush(heap, (-gain * acceptance[i], i))
    return ks


def record(seq: Sequence, drafted: int, accepted: int, step: int) -> None:
    state = seq.spec
    assert state is not None
    decided = accepted + (1 if accepted < drafted else 0)
    state.accepted = 0.8 * state.accepted + accepted
    state.tried = 0.8 * state.tried + decided
    state.last_verify = step


