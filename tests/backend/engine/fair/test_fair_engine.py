"""The fair scheduler in the real engine (SmolLM2): greedy outputs unchanged, served tokens follow weights."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
import torch

from edgeinfer.backend.engine.engine import EngineObserver, LLMEngine, RequestError
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams, TenantSpec

_ids = itertools.count()


def prompts(n: int, seed: int = 0, base: int = 5, step: int = 13) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49000, (base + step * i,), generator=g).tolist() for i in range(n)]


def request(prompt: list[int], tenant: TenantSpec | None, max_tokens: int) -> GenerateRequest:
    ns = f"tenant:{tenant.id}" if tenant else "t"
    return GenerateRequest(f"r{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                     ignore_eos=True), ns, tenant=tenant)


async def tokens(eng: LLMEngine, req: GenerateRequest) -> list[int]:
    out: list[int] = []
    async for c in eng.generate(req):
        out += c.token_ids
        assert c.error is None, c.error
    return out


@pytest.fixture(scope="module")
def solo(smol_model, smol_tokenizer):
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(enable_prefix_cache=False, scheduler="fifo"))
    eng.start()
    try:
        async def go():
            return [await tokens(eng, request(p, None, 12)) for p in prompts(6)]
        return asyncio.run(go())
    finally:
        eng.stop()


TENANTS = [TenantSpec("a", 1.0), TenantSpec("b", 2.0, priority=1), TenantSpec("c", 0.5, retain=False)]


@pytest.mark.parametrize("num_pages", [None, 10], ids=["ample-pages", "forced-preemption"])
async def test_greedy_outputs_under_fair_scheduling_equal_solo(smol_model, smol_tokenizer, solo, num_pages):
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=num_pages, max_num_batched_tokens=48,
                                                             scheduler="fair", enable_prefix_cache=False))
    eng.start()
    try:
        reqs = [request(p, TENANTS[i % 3], 12) for i, p in enumerate(prompts(6))]
        got = await asyncio.gather(*[tokens(eng, r) for r in reqs])
        assert got == solo
        if num_pages is not None:
            assert eng.scheduler.num_preemptions > 0
        assert eng.blocks.num_used == 0
    finally:
        eng.stop()


class ServedTokens(EngineObserver):
    def __init__(self) -> None:
        self.served: Counter[str] = Counter()

    def on_step(self, engine, batch, dt: float) -> None:
        for s in batch.decodes:
            self.served[s.tenant.id] += 1
        for s, n in batch.prefills:
            self.served[s.tenant.id] += n


def saturated_run(model, tok, scheduler: str, steps: int) -> Counter[str]:
    """Two tenants (weights 1 and 2) each keep 4 requests waiting; the engine stepped by hand (no thread)."""
    eng = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduler=scheduler,
                                             enable_prefix_cache=False, speculative="off"))   # one token per decode
    obs = ServedTokens()
    eng.observers.append(obs)
    tenants = [TenantSpec("w1", 1.0), TenantSpec("w2", 2.0)]
    prompt = prompts(1, seed=3, base=8)[0]
    for _ in range(steps):
        for t in tenants:
            while sum(1 for s in eng.scheduler.waiting if s.tenant.id == t.id) < 4:
                seq = eng._make_seq(request(prompt, t, 8), lambda chunk: None)
                eng._seqs[seq.request_id] = seq
                eng.scheduler.add(seq)
        eng.step()
    return obs.served


def test_weight_two_tenant_gets_twice_the_served_tokens(smol_model, smol_tokenizer):
    served = saturated_run(smol_model, smol_tokenizer, "fair", 48)
    assert served["w2"] / served["w1"] == pytest.approx(2.0, rel=0.15), served
    fifo = saturated_run(smol_model, smol_tokenizer, "fifo", 30)
    assert fifo["w2"] / fifo["w1"] == pytest.approx(1.0, rel=0.15), fifo


async def test_tenant_spec_is_validated(smol_model, smol_tokenizer):
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=64))
    bad = [(TenantSpec("x", weight=0.0), "tenant.weight=0.0"), (TenantSpec("", 1.0), "tenant.id is empty"),
           (TenantSpec("x", priority=12), "tenant.priority=12"),
           (TenantSpec("x", max_running_pages=2), "may hold at most 2")]
    for spec, match in bad:
        with pytest.raises(RequestError, match=match):
            eng.validate(request(list(range(1, 60)), spec, 4))


def test_the_contended_cap_comes_from_measured_steps(smol_model, smol_tokenizer, solo):
    """contended_step_ratio 1 (the default), the fixed cap raised to 200 so the derived one is told from it:
    tenant a alone runs varied steps, from which the engine fits what its steps cost (a prefill token costs
    something measurable on a CPU); then a and b together: every contended step's prefill is within the cap
    derived from that fit (a few dozen tokens on a CPU, not 200), greedy outputs equal their solo runs, and the
    metrics show the cap and the fit."""
    from edgeinfer.backend.metrics import BackendMetrics

    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(max_num_batched_tokens=256, contended_window_s=0.0,
                                                             contended_step_tokens=200, enable_prefix_cache=False))
    metrics = BackendMetrics("m")
    steps: list[tuple[int, int, bool]] = []     # prefill tokens, cap in force, contended

    class Steps(EngineObserver):
        contended = 0

        def on_step(self, engine, batch, dt: float) -> None:
            c = engine.scheduler.num_contended_steps
            steps.append((sum(n for _, n in batch.prefills), engine.scheduler.contended_cap, c > self.contended))
            self.contended = c

    eng.observers += [metrics, Steps()]
    outs: dict[int, list[int]] = {}

    def submit(i: int, p: list[int], tenant: TenantSpec, max_tokens: int) -> None:
        seq = eng._make_seq(request(p, tenant, max_tokens), lambda chunk, out=outs.setdefault(i, []):
                            out.extend(chunk.token_ids))
        eng._seqs[seq.request_id] = seq
        eng.scheduler.add(seq)

    for rnd in range(4):                        # a alone: steps of every size, none contended
        for j, p in enumerate(prompts(8, seed=3 + rnd, base=8, step=37)):
            submit(100 + 10 * rnd + j, p, TenantSpec("a"), 4)
        while eng.scheduler.has_work:
            eng.step()
    assert not any(c for *_, c in steps) and eng.step_cost.coef is not None
    a0, bd, bp = eng.step_cost.coef
    assert bp > 0, eng.step_cost.coef
    steps.clear()
    for i, p in enumerate(prompts(6)):
        submit(i, p, TenantSpec("a") if i % 2 else TenantSpec("b"), 12)
    while eng.scheduler.has_work:
        eng.step()
    contended = [(n, cap) for n, cap, c in steps if c]
    assert contended and all(n <= cap < 200 for n, cap in contended), contended
    assert [outs[i] for i in range(6)] == solo
    metrics.on_step(eng, None, 0.0)
    val = metrics.registry.get_sample_value
    assert val("edgeinfer_backend_contended_steps_total", {"model": "m"}) == eng.scheduler.num_contended_steps
    assert val("edgeinfer_backend_contended_step_prefill_tokens", {"model": "m"}) == eng.scheduler.contended_cap
    assert val("edgeinfer_backend_step_cost_seconds", {"model": "m", "part": "prefill_token"}) == \
        eng.step_cost.coef[2] > 0


def test_per_tenant_metrics(smol_model, smol_tokenizer):
    from edgeinfer.backend.metrics import BackendMetrics

    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    metrics, served = BackendMetrics("m"), ServedTokens()
    eng.observers += [metrics, served]
    specs = [TenantSpec("x"), TenantSpec("y", retain=False)]
    for i, p in enumerate(prompts(4, seed=5, base=40, step=0)):
        seq = eng._make_seq(request(p, specs[i % 2], 3), lambda chunk: None)
        eng._seqs[seq.request_id] = seq
        eng.scheduler.add(seq)
    while eng.scheduler.has_work:
        eng.step()
    metrics.on_step(eng, None, 0.0)            # what GET /metrics does: no batch
    val = metrics.tenant_registry.get_sample_value
    for t in ("x", "y"):
        got = sum(val("edgeinfer_backend_tenant_served_tokens_total", {"model": "m", "tenant": t, "kind": k}) or 0
                  for k in ("prefill", "decode"))
        assert got == served.served[t] > 0
        assert val("edgeinfer_backend_tenant_queue_seconds_count", {"model": "m", "tenant": t}) == 2
        assert val("edgeinfer_backend_tenant_virtual_tokens", {"model": "m", "tenant": t}) > 0
    assert val("edgeinfer_backend_tenant_cached_pages", {"model": "m", "tenant": "x"}) == eng.blocks.held["x"] == 4
    assert val("edgeinfer_backend_tenant_cached_pages", {"model": "m", "tenant": "y"}) is None   # retains nothing


def test_greedy_outputs_equal_solo_when_preempted_for_fairness(smol_model, smol_tokenizer, solo):
    """A fills both slots and has answered a few tokens when B arrives: one of A's sequences is preempted
    mid-answer for B (fair_preemption), recomputed later; every output still equals its solo run."""
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                                             scheduler="fair", enable_prefix_cache=False))
    outs: dict[str, list[int]] = {}
    ps = prompts(3)

    def submit(prompt: list[int], tenant: TenantSpec) -> str:
        seq = eng._make_seq(request(prompt, tenant, 12), lambda chunk, out=outs.setdefault(
            f"{tenant.id}{len(outs)}", []): out.extend(chunk.token_ids))
        eng._seqs[seq.request_id] = seq
        eng.scheduler.add(seq)
        return seq.request_id

    a = [eng._seqs[submit(p, TenantSpec("a"))] for p in ps[:2]]
    for _ in range(4):
        eng.step()
    answered = [len(s.output_ids) for s in a]
    submit(ps[2], TenantSpec("b"))
    eng.step()
    assert eng.scheduler.num_fair_preemptions == 1
    victim = next(s for s in a if s.num_fair_preemptions)
    assert answered[a.index(victim)] >= 2 and victim.num_computed_tokens == 0
    while eng.scheduler.has_work:
        eng.step()
    assert list(outs.values()) == solo[:3]


def test_greedy_outputs_equal_solo_under_the_contended_step_cap(smol_model, smol_tokenizer, solo):
    """Two tenants with a 16-token contended cap (prompts of 5-70 tokens are chunked into many small prefill
    steps, A's and B's interleaved): every greedy output equals its solo run; the cap acted (steps were capped,
    none gave more than 16 prefill tokens), and once A is alone past the window its steps take the full budget."""
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(max_num_batched_tokens=256, contended_step_tokens=16,
                                                             contended_step_ratio=0.0, contended_window_s=0.0,
                                                             scheduler="fair", enable_prefix_cache=False))
    outs: dict[int, list[int]] = {}
    sizes: list[int] = []
    ps = prompts(6)

    def submit(i: int, tenant: TenantSpec) -> None:
        seq = eng._make_seq(request(ps[i], tenant, 12), lambda chunk, out=outs.setdefault(i, []):
                            out.extend(chunk.token_ids))
        eng._seqs[seq.request_id] = seq
        eng.scheduler.add(seq)

    class Sizes(EngineObserver):
        def on_step(self, engine, batch, dt: float) -> None:
            sizes.append(sum(n for _, n in batch.prefills))

    eng.observers.append(Sizes())

    def run() -> None:
        while eng.scheduler.has_work:
            eng.step()

    for i in range(4):
        submit(i, TenantSpec("a") if i % 2 else TenantSpec("b"))
    run()
    assert eng.scheduler.num_contended_steps > 0 and max(sizes) == 16     # type: ignore[attr-defined]
    sizes.clear()
    for i in (4, 5):
        submit(i, TenantSpec("a"))                                          # alone (window 0): uncapped
    run()
    assert max(sizes) == len(ps[4]) + len(ps[5]) > 16
    assert [outs[i] for i in range(6)] == solo
