"""edgeinfer.backend.engine.step_cost.StepCost: the least-squares model of a step's time the fair scheduler's contended
cap is derived from (the cap itself: tests/backend/engine/fair/test_contended_budget.py)."""

from __future__ import annotations

import random

import pytest

from edgeinfer.backend.engine.step_cost import StepCost
from tests.support.step_costs import CPU, steps


def close(coef, want, rel: float) -> bool:
    return coef is not None and all(abs(c - w) <= rel * w for c, w in zip(coef, want))


def test_fit_recovers_the_machine_and_skips_warmup_steps():
    sc = StepCost(warmup_steps=4)
    for _ in range(4):
        sc.observe(1, 500, 5.0)                  # one-off costs of the first steps: not kept
    assert sc.coef is None and sc.predict(1, 1) is None and sc.prefill_within(1.0, 4) is None
    steps(sc, 200)
    assert close(sc.coef, CPU, 1e-6)
    noisy = StepCost(warmup_steps=0)
    steps(noisy, 300, noise=0.1)
    assert close(noisy.coef, CPU, 0.1)


def test_no_fit_until_prefill_cost_can_be_told_from_the_fixed_cost():
    sc = StepCost(warmup_steps=0, min_samples=24)
    steps(sc, 200, prefills=(0,))                # decode-only steps: one stratum
    assert sc.coef is None
    steps(sc, 30, prefills=(200, 400))
    assert close(sc.coef, CPU, 1e-6)
    few = StepCost(warmup_steps=0, min_samples=24)
    steps(few, 23)
    assert few.coef is None


def test_a_long_run_of_one_kind_of_step_does_not_lose_the_others():
    """A sustained flood capped to one size (8 decodes + 30 prefill tokens, 5000 steps): the fit still knows
    what a prefill token costs, because the other strata keep their steps (a plain window would hold only
    identical rows, from which b_prefill cannot be told from a)."""
    sc = StepCost(warmup_steps=0)
    rng = random.Random(1)
    steps(sc, 300, noise=0.05, rng=rng)
    steps(sc, 5000, noise=0.05, rng=rng, prefills=(30,), decodes=1)
    assert close(sc.coef, CPU, 0.15)
    assert sc.prefill_within(1.0, 8) in range(24, 33)           # (20 + 8) ms / 1 ms
    assert sc.prefill_within(1.0, 0) in range(17, 24)


def test_the_fit_follows_a_slower_machine():
    sc = StepCost(warmup_steps=0, per_stratum=64)
    steps(sc, 300)
    slow = tuple(2 * c for c in CPU)
    steps(sc, 4 * 64 * 2, coef=slow)             # every stratum refilled
    assert close(sc.coef, slow, 1e-6)


def test_prefill_within():
    sc = StepCost(warmup_steps=0)
    steps(sc, 100)
    assert sc.predict(6, 10) == pytest.approx(0.036)
    assert sc.prefill_within(1.0, 0) == 20 and sc.prefill_within(1.0, 6) == 26 and sc.prefill_within(0.5, 6) == 13
    free = StepCost(warmup_steps=0)
    steps(free, 100, coef=(0.008, 0.0001, 0.0))               # prefill tokens cost nothing measurable
    assert free.prefill_within(1.0, 4) >= 1 << 30


def test_empty_or_untimed_steps_are_ignored():
    sc = StepCost(warmup_steps=0)
    sc.observe(0, 0, 0.5)
    sc.observe(3, 10, 0.0)
    sc.observe(3, 10, float("nan"))
    assert sum(len(s) for s in sc.strata) == 0
