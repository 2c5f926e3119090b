"""Scheduling policy of backend.engine.fair (VTC) against the real BlockManager, execution simulated (sim.py)."""

from __future__ import annotations

import pytest

from edgeinfer.backend.engine.fair import FairScheduler
from edgeinfer.backend.engine.scheduler import Scheduler
from edgeinfer.protocol.wire import TenantSpec
from tests.support.fair_sim import Sim, seq

A, B = TenantSpec("a"), TenantSpec("b")


def saturate(sim: Sim, tenants: list[TenantSpec], steps: int, queue: int = 6, **kw) -> None:
    """Keep `queue` requests of every tenant waiting; run `steps` steps."""
    for _ in range(steps):
        for t in tenants:
            while sum(1 for s in sim.sched.waiting if s.tenant.id == t.id) < queue:
                sim.add(seq(t, **kw))
        sim.step()


def test_make_scheduler_follows_config():
    assert type(Sim(scheduler="fair").sched) is FairScheduler
    assert type(Sim(scheduler="fifo").sched) is Scheduler


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 2.0), (1.0, 4.0)])
def test_served_tokens_follow_weights_under_saturation(weights):
    ta, tb = TenantSpec("a", weights[0]), TenantSpec("b", weights[1])
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64)
    saturate(sim, [ta, tb], 600, prompt_len=24, max_new=16)
    ratio = sim.served["b"] / sim.served["a"]
    assert ratio == pytest.approx(weights[1] / weights[0], rel=0.1), sim.served


def test_fifo_ignores_weights():
    """The same load under scheduler=fifo: served tokens follow arrival order, not the weights."""
    sim = Sim(scheduler="fifo", max_num_seqs=4, max_num_batched_tokens=64)
    saturate(sim, [TenantSpec("a", 1.0), TenantSpec("b", 2.0)], 600, prompt_len=24, max_new=16)
    assert sim.served["b"] / sim.served["a"] == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("scheduler", ["fair", "fifo"])
def test_late_tenant_is_admitted_at_the_next_free_slot(scheduler):
    """A floods 40 requests, then B sends one: fair admits B as soon as a slot frees; FIFO after all of A's."""
    sim = Sim(scheduler=scheduler, max_num_seqs=4)
    for _ in range(40):
        sim.add(seq(A, max_new=4))
    sim.step()
    b = sim.add(seq(B, max_new=4))
    while b.request_id not in sim.admitted:
        sim.step()
    before_b = sim.admitted.index(b.request_id)
    if scheduler == "fair":
        assert before_b <= 8      # the 4 admitted at once + the next slot
    else:
        assert before_b == 40


def test_idle_time_is_not_banked_as_credit():
    """A runs alone for a long time; when B arrives its counter is lifted to A's, so B shares, not monopolizes."""
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64)
    saturate(sim, [A], 300, prompt_len=24, max_new=16)
    sim.served.clear()
    saturate(sim, [A, B], 300, prompt_len=24, max_new=16)
    assert sim.served["b"] / sim.served["a"] == pytest.approx(1.0, rel=0.15), sim.served


def test_budget_of_a_step_is_split_between_tenants():
    """Two long prompts arrive together: the step's prefill budget goes to both tenants, not to the first
    (the whole budget: contended cap off)."""
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64, contended_step_tokens=0)
    sim.add(seq(A, prompt_len=256))
    sim.add(seq(B, prompt_len=256))
    given: dict[str, int] = {"a": 0, "b": 0}
    for _ in range(4):
        for s, n in sim.step().prefills:
            given[s.tenant.id] += n
    assert given["a"] == given["b"] == 128


def test_priority_class_goes_first_and_low_class_ages_in():
    hi, lo = TenantSpec("hi", priority=0), TenantSpec("lo", priority=2)
    sim = Sim(max_num_seqs=2, priority_aging_steps=40)
    low = sim.add(seq(lo, max_new=4))
    steps = 0
    while low.request_id not in sim.admitted:     # hi keeps 4 waiting at all times
        saturate(sim, [hi], 1, queue=4, max_new=4)
        steps += 1
        assert steps <= 200, "the low class starved"
    assert steps >= 80                             # two classes to climb: 2 * priority_aging_steps
    assert all(r.startswith("hi-") for r in sim.admitted[:sim.admitted.index(low.request_id)])


def _preemption_scene(scheduler: str):
    """A runs 3 sequences, B (admitted last) 1; 9 pages: the growth past 2 pages each (33 tokens) runs out."""
    sim = Sim(scheduler=scheduler, num_pages=9, max_num_seqs=8, max_num_batched_tokens=512)
    for _ in range(3):
        sim.add(seq(A, prompt_len=20, max_new=200))
    sim.step()
    sim.add(seq(B, prompt_len=20, max_new=200))
    preempted = []
    for _ in range(40):
        preempted += sim.step().preempted
        if preempted:
            return sim, preempted[0]
    raise AssertionError("no preemption")


def test_preemption_takes_the_tenant_most_over_its_share():
    """Out of pages: the victim is a sequence of the tenant with the largest counter, not simply the newest."""
    sim, victim = _preemption_scene("fair")
    assert victim.tenant.id == "a"
    assert sim.sched.counters["a"] > sim.sched.counters["b"]


def test_preemption_under_fifo_takes_the_newest():
    sim, victim = _preemption_scene("fifo")
    assert victim.tenant.id == "b"


def test_running_page_cap_holds_and_a_sole_sequence_ends_at_it():
    capped = TenantSpec("c", max_running_pages=6)
    sim = Sim(max_num_seqs=8)
    for _ in range(6):
        sim.add(seq(capped, prompt_len=30, max_new=80))
    peak = 0
    for _ in range(3000):
        sim.step()
        peak = max(peak, sum(len(s.block_table) for s in sim.sched.running))
        if not sim.sched.has_work:
            break
    assert peak <= 6
    assert not sim.sched.has_work and len(sim.finished) == 6
    # 6 pages hold 96 tokens: a 30-token prompt stops there, before its 80 new tokens
    assert all(s.num_computed_tokens <= 96 for s in sim.finished)
    assert sum(1 for s in sim.finished if len(s.output_ids) < 80) >= 1


def test_page_cap_does_not_limit_other_tenants():
    sim = Sim(max_num_seqs=8, contended_step_tokens=0)     # one step admits all five (100 tokens): no step cap
    for _ in range(4):
        sim.add(seq(TenantSpec("c", max_running_pages=2), prompt_len=20, max_new=4))
        sim.add(seq(B, prompt_len=20, max_new=4))
    sim.step()
    running = [s.tenant.id for s in sim.sched.running]
    assert running.count("c") == 1 and running.count("b") == 4
