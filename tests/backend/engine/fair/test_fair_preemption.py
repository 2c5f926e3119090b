"""Preemption for fairness (backend.engine.fair, fair_preemption): a tenant below its slot share does not wait
for a flooding tenant's running requests to finish. Real BlockManager + scheduler, execution simulated."""

from __future__ import annotations

from collections import Counter

import pytest

from edgeinfer.protocol.wire import TenantSpec
from tests.support.fair_sim import Sim, seq

A, B = TenantSpec("a"), TenantSpec("b")


def flooded(**cfg) -> Sim:
    """A holds all 4 slots with long answers (and keeps 8 more waiting), 3 steps in."""
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64, **cfg)
    for _ in range(12):
        sim.add(seq(A, prompt_len=20, max_new=200))
    for _ in range(3):
        sim.step()
    assert [s.tenant.id for s in sim.sched.running] == ["a"] * 4
    return sim


def test_under_share_tenant_is_admitted_at_the_next_step():
    """Without preemption B waits ~200 steps for one of A's requests to end; with it, one step."""
    sim = flooded()
    b = sim.add(seq(B, prompt_len=20, max_new=4))
    batch = sim.step()
    assert b.request_id in sim.admitted
    assert [s.tenant.id for s in batch.preempted] == ["a"]
    victim = batch.preempted[0]
    assert victim.output_ids and victim.num_fair_preemptions == 1      # it had answered; recompute keeps that
    assert victim is sim.sched.waiting[0]                              # A's next admission
    assert sum(s.tenant.id == "a" for s in sim.sched.running) == 3     # A keeps decoding


def test_no_preemption_when_disabled_or_fifo():
    for cfg in ({"fair_preemption": False}, {"scheduler": "fifo"}):
        sim = flooded(**cfg)
        b = sim.add(seq(B, prompt_len=20, max_new=4))
        for _ in range(20):
            assert not sim.step().preempted
        assert b.request_id not in sim.admitted, cfg


@pytest.mark.parametrize("weights,expect", [((1.0, 1.0), {"a": 2, "b": 2}), ((1.0, 3.0), {"a": 1, "b": 3})])
def test_preemption_stops_at_the_slot_share(weights, expect):
    """B floods too: slots settle at the weighted share (4 * w / sum w), no back-and-forth after that."""
    ta, tb = TenantSpec("a", weights[0]), TenantSpec("b", weights[1])
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64)
    for _ in range(12):
        sim.add(seq(ta, prompt_len=20, max_new=300))
    for _ in range(3):
        sim.step()
    for _ in range(12):
        sim.add(seq(tb, prompt_len=20, max_new=300))
    for _ in range(6):
        sim.step()
    settled = sim.sched.num_preemptions             # ample pages: every preemption is one for fairness
    for _ in range(50):
        sim.step()
        assert Counter(s.tenant.id for s in sim.sched.running) == expect
    assert sim.sched.num_preemptions == settled == 4 - expect["a"]


def test_every_request_finishes_and_is_preempted_at_most_once():
    """B keeps one request in flight, new ones arriving as the last ends (the benchmark's closed loop): A's
    requests are preempted over and over as B comes back, but each at most max_fair_preemptions (1) times,
    and A keeps being served (no starvation)."""
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64)
    a_reqs = [sim.add(seq(A, prompt_len=20, max_new=30)) for _ in range(16)]
    b_done = 0
    for _ in range(3000):
        if not any(s.tenant.id == "b" for s in (*sim.sched.waiting, *sim.sched.running)):
            sim.add(seq(B, prompt_len=20, max_new=4))
            b_done += 1
        sim.step()
        if all(s in sim.finished for s in a_reqs):
            break
    assert all(s in sim.finished and len(s.output_ids) == 30 for s in a_reqs)
    assert max(s.num_preemptions for s in a_reqs) == 1          # ample pages: all of them for fairness
    assert sum(s.num_preemptions for s in a_reqs) >= 4
    assert b_done >= 20


def test_capped_tenant_does_not_preempt():
    """A waiting request its tenant's page cap would not admit anyway takes no one's slot."""
    capped = TenantSpec("b", max_running_pages=3)
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64)
    sim.add(seq(capped, prompt_len=20, max_new=300))
    for _ in range(3):
        sim.add(seq(A, prompt_len=20, max_new=300))
    for _ in range(3):
        sim.step()
    sim.add(seq(capped, prompt_len=20, max_new=4))   # 2 pages held + 2 more > 3
    for _ in range(10):
        assert not sim.step().preempted


@pytest.mark.parametrize("isolation", [True, False])
def test_first_token_of_an_under_share_tenant_is_not_slowed_by_the_flood_prefill(isolation):
    """A holds the 4 slots, 3 decoding and 1 long prompt mid-prefill, when B's short prompt arrives (and takes a
    slot by preemption): with prefill_isolation B's step carries A's decodes and B's prefill only (A's chunk
    waits one step, then goes on); without it A's chunk fills the rest of the step's budget."""
    # (contended cap off: what is tested is isolation, not the step budget)
    sim = Sim(max_num_seqs=4, max_num_batched_tokens=64, prefill_isolation=isolation, contended_step_tokens=0)
    for _ in range(3):
        sim.add(seq(A, prompt_len=16, max_new=50))
    long = sim.add(seq(A, prompt_len=400, max_new=8))
    for _ in range(2):
        sim.step()
    assert long.is_prefilling and len(sim.sched.running) == 4
    b = sim.add(seq(B, prompt_len=20, max_new=4))
    batch = sim.step()
    prefill = {s.tenant.id: n for s, n in batch.prefills}
    assert prefill.get("b") == 20 and len(b.output_ids) == 1 and len(batch.decodes) == 2
    assert prefill.get("a", 0) == (0 if isolation else 64 - 2 - 20)
    computed = long.num_computed_tokens
    sim.step()
    assert long.num_computed_tokens > computed                     # A's prefill goes on at the next step
