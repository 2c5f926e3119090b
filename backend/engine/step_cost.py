"""What a step costs on this machine, measured: dt = a + b_decode * D + b_prefill * P for a step with D decoding
sequences and P prefill tokens, fitted by least squares of the relative error (a machine's jitter is about
proportional to the step) over the engine's recent steps.

Used by the fair scheduler's contended step budget (backend.engine.fair): while more than one tenant is active,
a step computes at most the prefill tokens that keep its prefill part within `ratio` times the rest of the step
(the predicted time of its decodes and its fixed cost), so how long a newly arrived request waits for the step
in flight follows from the machine's own costs, not from a token count tuned on one of them. Where a step's
time barely grows with its tokens (a GPU at small batch: the weights are read once per step whatever the
batch) the derived cap exceeds the budget and nothing is capped; where it grows linearly (a CPU: every token
is its own matrix-vector work) the cap is the few tokens that take about as long as the decodes.

Samples are kept per stratum of P (none, < 32, < 128, more), the newest `per_stratum` of each, so a long run of
one kind of step (a sustained flood capped to one size) never pushes out the steps that tell a from b_prefill:
a sliding window or exponential forgetting would lose them, and the fit would drift with nothing to correct it.
The first `warmup_steps` steps are not kept (the first forward passes pay one-off costs: page faults on the
weights, kernel set-up). Not modelled: attention's growth with the context of a prefill chunk (a chunk deep in a
long prompt costs more than the fit says), steps slowed by a neighbour on a shared machine (they stay until
newer steps of their stratum replace them).
"""

from __future__ import annotations

from collections import deque

import numpy as np

STRATA = (1, 32, 128)       # prefill-token bounds of the strata: [0], [1, 32), [32, 128), [128, ...)


class StepCost:
    def __init__(self, per_stratum: int = 64, warmup_steps: int = 4, min_samples: int = 24,
                 refit_every: int = 8) -> None:
        self.strata: list[deque[tuple[int, int, float]]] = [deque(maxlen=per_stratum) for _ in range(len(STRATA) + 1)]
        self.warmup_steps = warmup_steps
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.coef: tuple[float, float, float] | None = None    # (a, b_decode, b_prefill) in seconds; None: no fit
        self._since_fit = 0

    def observe(self, decodes: int, prefill_tokens: int, dt: float) -> None:
        """One step's measure (engine thread, after the step)."""
        if decodes + prefill_tokens <= 0 or not dt > 0:
            return
        if self.warmup_steps > 0:
            self.warmup_steps -= 1
            return
        i = sum(prefill_tokens >= b for b in STRATA)
        self.strata[i].append((decodes, prefill_tokens, dt))
        self._since_fit += 1
        if self.coef is None or self._since_fit >= self.refit_every:
            self._fit()

    def _fit(self) -> None:
        rows = [r for s in self.strata for r in s]
        if len(rows) < self.min_samples or sum(1 for s in self.strata if s) < 2:
            return                  # prefill's own cost cannot be told from the fixed cost yet
        self._since_fit = 0
        m = np.asarray(rows, dtype=np.float64)
        x = np.column_stack([np.ones(len(m)), m[:, 0], m[:, 1]]) / m[:, 2:3]
        coef = np.linalg.lstsq(x, np.ones(len(m)), rcond=None)[0]     # relative errors: a 500-token step's
        # jitter would otherwise outweigh all of a decode step's time
        self.coef = float(coef[0]), float(coef[1]), float(coef[2])

    def predict(self, decodes: int, prefill_tokens: int) -> float | None:
        """Predicted seconds of a step; None before a fit."""
        if self.coef is None:
            return None
        a, bd, bp = self.coef
        return a + bd * decodes + bp * prefill_tokens

    def prefill_within(self, ratio: float, decodes: int) -> int | None:
        """The most prefill tokens whose predicted time is at most `ratio` times the predicted time of a step
        with `decodes` decoding sequences and no prefill; None before a fit. A prefill token that costs
        nothing measurable (b_prefill <= 0) gives no bound: a very large number."""
        if self.coef is None:
            return None
        a, bd, bp = self.coef
        base = a + bd * decodes
        if bp <= 0 or base <= 0:
            return 1 << 30
        return int(min(ratio * base / bp * (1 + 1e-9), 1 << 30))     # 20.0 is 20, not 19.999
