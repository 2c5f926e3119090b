"""Feed a backend.engine.step_cost.StepCost the steps of a machine with known costs (tests of the fit, of the
contended cap derived from it, and of the wait estimate)."""

from __future__ import annotations

import random

from edgeinfer.backend.engine.step_cost import StepCost

CPU = (0.020, 0.001, 0.001)        # a, per decode, per prefill token (seconds): a token costs about a decode
PREFILLS = (0, 5, 20, 40, 100, 300, 500)


def steps(sc: StepCost, n: int, coef=CPU, noise: float = 0.0, rng=None, prefills=PREFILLS, decodes=9) -> None:
    """n steps of 0..decodes-1 decoding sequences and `prefills` tokens in turn, each taking
    a + bd * D + bp * P seconds times a uniform jitter of +-noise."""
    rng = rng or random.Random(0)
    a, bd, bp = coef
    for i in range(n):
        d, p = i % decodes, prefills[i % len(prefills)]
        sc.observe(d, p, (a + bd * d + bp * p) * (1 + rng.uniform(-noise, noise)))


def measured(a: float, bd: float, bp: float, n: int = 200) -> StepCost:
    """A StepCost fed n exact steps of a machine whose step takes a + bd * decodes + bp * prefill tokens."""
    sc = StepCost(warmup_steps=0)
    steps(sc, n, coef=(a, bd, bp))
    return sc
