"""edgeinfer.backend.engine.backlog: the estimated wait for a first token that --max-queue-wait-s is checked against.
(Scheduler stand-ins: only what Backlog reads: the two queues, two attributes per sequence, prefill_per_step.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edgeinfer.backend.engine.backlog import Backlog
from edgeinfer.backend.engine.step_cost import StepCost
from tests.support.step_costs import measured


def seq(uncomputed: int) -> SimpleNamespace:
    return SimpleNamespace(num_uncomputed=uncomputed, is_prefilling=uncomputed > 1)


def sched(waiting=(), running=(), budget: int = 512) -> SimpleNamespace:
    return SimpleNamespace(waiting=[seq(n) for n in waiting], running=[seq(n) for n in running],
                           prefill_per_step=lambda decodes: max(1, budget - decodes))    # Scheduler's, uncapped


def test_no_estimate_until_a_full_step_after_the_warmup_was_measured():
    b = Backlog(512, warmup_steps=2)
    assert b.wait_s(100) is None
    b.on_step(sched(), 100, 0.1)            # under half the budget: not a measure of the rate
    b.on_step(sched(), 512, 30.0)           # warm-up steps (one-off costs): ignored
    b.on_step(sched(), 512, 20.0)
    assert b.wait_s(100) is None and b.tok_s is None
    b.on_step(sched(), 512, 1.0)
    assert b.tok_s == 512
    assert b.wait_s(512) == pytest.approx(1.0)


def test_wait_counts_queued_prompts_submitted_ones_and_the_decode_share():
    b = Backlog(512, alpha=1.0, warmup_steps=0)
    b.on_step(sched(waiting=[1000, 500], running=[300, 1, 1]), 512, 0.5)   # 1024 tok/s; 2 decoding
    assert (b.queued_tokens, b.decoding) == (1800, 2)
    b.submitted, b.handled = 2000, 1700          # 300 prompt tokens not yet in the scheduler
    ahead = 1800 + 300 + 200
    assert b.wait_s(200) == pytest.approx(ahead / (1024 * 510 / 512))
    assert b.retry_after_s(200, bound_s=1.0) == int(-(-(b.wait_s(200) - 1.0) // 1))
    assert b.retry_after_s(1, bound_s=1e6) == 1   # at least 1 s


def test_an_emptied_scheduler_leaves_no_stale_backlog():
    b = Backlog(512, warmup_steps=0)
    b.on_step(sched(waiting=[4000]), 512, 1.0)
    assert b.wait_s(0) == pytest.approx(4000 / 512)
    b.observe(sched())                          # the engine went idle (all aborted)
    assert b.wait_s(0) == 0.0


def test_contended_steps_are_estimated_at_their_capped_size():
    """The fair scheduler caps contended steps to 26 prefill tokens; the step-cost fit says such a step with 2
    decodes takes 20 + 2 + 26 = 48 ms: the queued 1100 tokens need 1100 / 26 of them (2.03 s), not the 1.07 s
    the rate of full steps gives. Uncapped again, the full-step rate is used as before; no fit: as before."""
    b = Backlog(512, alpha=1.0, warmup_steps=0, step_cost=measured(0.020, 0.001, 0.001, n=100))
    s = sched(waiting=[1000], running=[1, 1])
    s.prefill_per_step = lambda decodes: 26
    b.on_step(s, 512, 0.5)                       # full steps: 1024 tok/s
    assert (b.per_step, b.decoding) == (26, 2)
    assert b.wait_s(100) == pytest.approx(1100 / 26 * 0.048)
    s.prefill_per_step = lambda decodes: 512 - decodes
    b.observe(s)
    assert b.wait_s(100) == pytest.approx(1100 / (1024 * 510 / 512))
    nofit = Backlog(512, alpha=1.0, warmup_steps=0, step_cost=StepCost())
    s.prefill_per_step = lambda decodes: 26
    nofit.on_step(s, 512, 0.5)
    assert nofit.wait_s(100) == pytest.approx(1100 / (1024 * 510 / 512))
