"""The contended step budget (backend.engine.fair, contended_step_tokens / contended_window_s): while more than
one tenant is active a step computes at most contended_step_tokens prefill tokens, so the step another
tenant's new request waits on stays short; a lone tenant's steps are unchanged. Real BlockManager + scheduler,
execution simulated (tests.support.fair_sim); the greedy-output check on the real model is in test_fair_engine.py."""

from __future__ import annotations

import pytest

from edgeinfer.backend.engine.backlog import Backlog
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.fair import CONTENDED_MIN_TOKENS
from edgeinfer.backend.server import parse_args
from edgeinfer.protocol.wire import TenantSpec
from tests.support.fair_sim import Sim, seq
from tests.support.step_costs import measured

A, B = TenantSpec("a"), TenantSpec("b")
BUDGET, CAP = 512, 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sim(cap: int = CAP, window: float = 1.0, **cfg) -> tuple[Sim, Clock]:
    s = Sim(num_pages=512, max_num_seqs=8, max_num_batched_tokens=BUDGET, contended_step_tokens=cap,
            contended_window_s=window, **cfg)
    clock = Clock()
    s.sched.clock = clock        # type: ignore[attr-defined]   # FairScheduler only; FIFO ignores the cap
    return s, clock


def prefill(batch) -> int:
    return sum(n for _, n in batch.prefills)


def test_cap_applies_only_while_another_tenant_is_active():
    """A alone: its long prompts fill the 512-token budget. B's request arrives: from that step on the step's
    prefill is at most CAP tokens (B's first token included), A's decodes still run every step."""
    s, _ = sim()
    for _ in range(10):
        s.add(seq(A, prompt_len=300, max_new=40))
    first = s.step()
    assert prefill(first) == BUDGET and s.sched.num_contended_steps == 0
    s.add(seq(B, prompt_len=20, max_new=4))
    for _ in range(30):
        batch = s.step()
        assert 0 < prefill(batch) <= CAP
    assert s.sched.num_contended_steps == 30
    assert any(d.tenant.id == "a" for d in batch.decodes)


def test_closed_loop_tenant_between_requests_still_counts_then_the_cap_releases():
    """B's request ends: for contended_window_s (B's client is sending its next one) A's steps stay capped;
    once the window has passed with B idle, A's steps take the whole budget again."""
    s, clock = sim(window=1.0)
    for _ in range(8):
        s.add(seq(A, prompt_len=400, max_new=40))
    b = s.add(seq(B, prompt_len=20, max_new=2))
    while b not in s.finished:
        assert prefill(s.step()) <= CAP
    assert s.sched.active_tenants() == {"a", "b"}             # B left just now: still active
    clock.now += 0.9
    assert prefill(s.step()) == CAP
    clock.now += 0.2                                          # 1.1 s since B left
    assert s.sched.active_tenants() == {"a"}
    batch = s.step()
    assert prefill(batch) == BUDGET - len(batch.decodes)      # lone tenant: the full budget again
    s.add(seq(B, prompt_len=20, max_new=2))                   # B comes back: capped at once
    assert prefill(s.step()) <= CAP


def test_lone_tenant_schedule_is_unchanged_by_the_cap():
    """With one tenant (and none within the window) every step is the same with the cap as without it."""
    runs = []
    for cap in (0, CAP):
        s, _ = sim(cap=cap)
        for i in range(12):
            s.add(seq(A, prompt_len=100 + 37 * i, max_new=20))
        trace = []
        while s.sched.has_work:
            b = s.step()
            trace.append(([d.request_id.split("-")[1] for d in b.decodes],
                          [(p.request_id.split("-")[1], n) for p, n in b.prefills]))
        runs.append((trace, s.sched.num_contended_steps))    # type: ignore[attr-defined]
    assert runs[0][1] == runs[1][1] == 0
    # request ids differ between the two runs (a global counter); compare the shape step by step
    shape = [[(len(d), [n for _, n in p]) for d, p in t] for t, _ in runs]
    assert shape[0] == shape[1] and len(shape[0]) > 10
    assert max(sum(ns) for _, ns in shape[1]) > CAP           # the lone tenant did use steps above the cap


def test_no_starvation_under_a_small_cap():
    """CAP 16, A floods with 16 requests (prompts up to 600 tokens) while B runs a closed loop: every A request
    finishes with all its tokens, B keeps being served, every step with prefill work computes some of it."""
    s, clock = sim(cap=16)
    a_reqs = [s.add(seq(A, prompt_len=40 + 37 * i, max_new=10)) for i in range(16)]
    b_done = 0
    for _ in range(5000):
        if not any(x.tenant.id == "b" for x in (*s.sched.waiting, *s.sched.running)):
            s.add(seq(B, prompt_len=60, max_new=4))
            b_done += 1
        pending = any(x.is_prefilling for x in s.sched.running)
        batch = s.step()
        clock.now += 0.01
        assert prefill(batch) <= 16
        assert prefill(batch) > 0 or not pending                 # prefill work never sits out a step
        if all(r in s.finished for r in a_reqs):
            break
    assert all(r in s.finished and len(r.output_ids) == 10 for r in a_reqs)
    assert b_done >= 20


def test_fifo_ignores_the_cap():
    s = Sim(num_pages=512, scheduler="fifo", max_num_seqs=8, max_num_batched_tokens=BUDGET, contended_step_tokens=CAP)
    for _ in range(3):
        s.add(seq(A, prompt_len=300, max_new=4))
    s.add(seq(B, prompt_len=300, max_new=4))
    assert prefill(s.step()) == BUDGET


def test_config_and_backend_flags():
    assert (EngineConfig().contended_step_tokens, EngineConfig().contended_step_ratio,
            EngineConfig().contended_window_s) == (32, 1.0, 1.0)
    for bad in ({"contended_step_tokens": -1}, {"contended_window_s": -0.5}, {"contended_window_s": float("inf")},
                {"contended_step_ratio": -1.0}, {"contended_step_ratio": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
    cfg = parse_args(["--insecure-no-internal-auth", "--contended-step-tokens", "96", "--contended-window-s", "2.5",
                      "--contended-step-ratio", "0.5"]).engine_config()
    assert (cfg.contended_step_tokens, cfg.contended_window_s, cfg.contended_step_ratio) == (96, 2.5, 0.5)
    default = parse_args(["--insecure-no-internal-auth"]).engine_config()
    assert (default.contended_step_tokens, default.contended_step_ratio, default.contended_window_s) == (32, 1.0, 1.0)
    for flags in (["--contended-step-tokens", "-3"], ["--contended-step-ratio", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(["--insecure-no-internal-auth", *flags])


def test_the_cap_follows_the_measured_step_cost():
    """CPU-like steps (a token costs about a decode: 20 ms + 1 ms per decode + 1 ms per prefill token): the cap
    is the prefill that takes as long as the rest of the step (ratio 1), so it grows with the step's decodes;
    before any measure (and with ratio 0) it is contended_step_tokens; never below CONTENDED_MIN_TOKENS."""
    s, _ = sim(cap=CAP)
    for _ in range(6):
        s.add(seq(A, prompt_len=30, max_new=40))
    s.step()                                                   # A alone: all six prefilled in one step
    s.add(seq(B, prompt_len=300, max_new=4))
    assert prefill(s.step()) == CAP                            # no StepCost: the fixed cap
    s.sched.step_cost = measured(0.020, 0.001, 0.001)          # type: ignore[attr-defined]
    batch = s.step()
    assert len(batch.decodes) == 6
    assert prefill(batch) == 20 + 6 == s.sched.contended_cap   # type: ignore[attr-defined]
    s.sched.step_cost = measured(0.004, 0.0005, 0.002)         # type: ignore[attr-defined]   # the floor
    assert prefill(s.step()) == CONTENDED_MIN_TOKENS
    s2, _ = sim(cap=CAP, contended_step_ratio=0.0)
    s2.sched.step_cost = measured(0.020, 0.001, 0.001)         # type: ignore[attr-defined]
    for _ in range(3):
        s2.add(seq(A, prompt_len=300, max_new=40))
    s2.add(seq(B, prompt_len=300, max_new=4))
    assert prefill(s2.step()) == CAP                           # ratio 0: the fixed cap whatever was measured


def test_no_cap_where_a_step_barely_grows_with_its_tokens():
    """GPU-like steps (8 ms whatever the batch, 5 us per prefill token): the derived cap is the whole budget,
    so a contended step takes it all, as an uncontended one does."""
    s, _ = sim(cap=CAP)
    s.sched.step_cost = measured(0.008, 0.00005, 0.000005)     # type: ignore[attr-defined]
    for _ in range(4):
        s.add(seq(A, prompt_len=300, max_new=40))
    s.add(seq(B, prompt_len=300, max_new=4))
    assert prefill(s.step()) == BUDGET and s.sched.num_contended_steps == 0     # type: ignore[attr-defined]
    assert s.sched.contended_cap == BUDGET                     # type: ignore[attr-defined]   # i.e. no cap


def test_the_overload_estimate_sees_the_contended_cap():
    """Backlog (the 503 wait estimate) reads the prefill a step computes now from the scheduler: the derived
    cap while two tenants are active, the whole budget less the decodes when one is."""
    s, clock = sim(cap=CAP, window=1.0)
    s.sched.step_cost = measured(0.020, 0.001, 0.001)          # type: ignore[attr-defined]
    for _ in range(6):
        s.add(seq(A, prompt_len=30, max_new=40))
    s.step()
    backlog = Backlog(BUDGET)
    backlog.observe(s.sched)
    assert backlog.per_step == BUDGET - 6                      # A alone
    b = s.add(seq(B, prompt_len=20, max_new=1))
    backlog.observe(s.sched)
    assert backlog.per_step == 20 + 6                          # contended: the derived cap for 6 decodes
    while b not in s.finished:
        s.step()
    clock.now += 1.5                                           # B left more than the window ago
    backlog.observe(s.sched)
    assert backlog.per_step == BUDGET - 6
