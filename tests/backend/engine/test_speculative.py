"""Speculative decoding (backend/engine/spec/) on a tiny random Llama (transformers' classes, safetensors),
fp32 KV, driven step by step.

- greedy: the output with n-gram drafts is exactly the output without them, for sequences decoding together and
  alone, with drafts accepted and rejected along the way; no page leaks; the pages sealed from a speculative run
  are the ones a plain run seals (a later prompt hits them and decodes the same tokens);
- sampling: the rejection rule keeps the target distribution: chi-square tests over many draws of the first and
  second emitted tokens against the model's own distributions (fixed seeds);
- the policy: no drafts above max_batch, none for a sequence with logprobs or a grammar, a sequence whose drafts
  keep missing pauses; the counters feed the metrics.
"""

from __future__ import annotations

import pytest
import torch

from edgeinfer.backend.engine.spec.policy import SpecPolicy, eligible
from edgeinfer.backend.engine.spec.state import NgramIndex
from edgeinfer.backend.engine.spec.verify import verify
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.model.loader import load_model
from edgeinfer.protocol.wire import SamplingParams
from tests.support.engine_steps import Stepper, engine
from tests.support.tiny import VOCAB, prompt, tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(tiny_llama(tmp_path_factory.mktemp("tiny")))


def copy_prompt(seed: int, n: int = 24, reps: int = 3) -> list[int]:
    """A prompt that repeats itself: its continuation is often a copy (drafts get accepted)."""
    return prompt(seed, n) * reps


def run(tiny, prompts: list[list[int]], max_tokens: int, **cfg) -> tuple[list[list[int]], object]:
    eng = engine(tiny, kv_dtype="fp32", num_pages=64, **cfg)
    s = Stepper(eng)
    for i, p in enumerate(prompts):
        s.add(f"r{i}", p, max_tokens)
    s.run()
    assert eng.blocks.num_used == 0           # every page given back, speculative or not
    return [s.tokens[f"r{i}"] for i in range(len(prompts))], eng


def test_ngram_index_proposes_the_continuation_of_the_latest_earlier_occurrence():
    idx = NgramIndex(2, 3)
    ids = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    idx.update(ids)
    assert idx.propose(ids, 2) == [5, 7]           # (1, 2, 3) last seen before position 8
    assert idx.propose([8, 9], 3) == []
    ids += [5, 7, 1]
    idx.update(ids)
    assert idx.propose(ids, 4) == [2, 3, 5, 7]     # (7, 1) -> 2, 3, 5, 7


@pytest.mark.parametrize("n_seqs", [1, 4])
def test_greedy_output_is_exactly_the_plain_output(tiny, n_seqs):
    prompts = [copy_prompt(s) for s in range(n_seqs)] + [prompt(100, 40)]
    plain, _ = run(tiny, prompts, 40, speculative="off")
    spec, eng = run(tiny, prompts, 40, speculative="ngram", spec_adaptive=False)
    assert spec == plain
    assert eng.speculation.stats.drafted > 0 and 0 < eng.speculation.stats.accepted < eng.speculation.stats.drafted   # accepted and rejected drafts


def test_sealed_pages_hold_only_accepted_tokens(tiny):
    """A second request whose prompt is the first's prompt + output hits the pages the speculative run sealed
    and continues exactly as the plain engine does."""
    p = copy_prompt(7)
    eng = engine(tiny, kv_dtype="fp32", num_pages=64, speculative="ngram", spec_adaptive=False)
    s = Stepper(eng)
    s.add("a", p, 48)
    s.run()
    follow = p + s.tokens["a"]
    b = s.add("b", follow, 8)
    s.run()
    assert b.num_cached_prompt_tokens >= (len(follow) - 1) // 16 * 16 - 16
    plain, _ = run(tiny, [follow], 8, speculative="off")
    assert s.tokens["b"] == plain[0]


def test_no_drafts_above_max_batch_or_for_logprobs(tiny):
    prompts = [copy_prompt(s) for s in range(3)]
    # all three prefill in one step (budget 512), then decode together: 3 > max_batch 2, so no drafts at all
    _, eng = run(tiny, prompts, 20, speculative="ngram", spec_max_batch=2, spec_adaptive=False,
                 max_num_batched_tokens=512)
    _, eng2 = run(tiny, prompts, 20, speculative="ngram", spec_max_batch=3, spec_adaptive=False,
                  max_num_batched_tokens=512)
    assert eng.speculation.stats.drafted == 0 and eng2.speculation.stats.drafted > 0
    s = Stepper(engine(tiny, kv_dtype="fp32", num_pages=64, spec_adaptive=False))
    seq = s.add("lp", copy_prompt(1), 20, logprobs=True)
    assert not eligible(seq)
    s.run()
    assert s.eng.speculation.stats.drafted == 0 and len(s.lps["lp"]) == 20


def _seq_with(acceptance: float, last_verify: int = 100):
    from edgeinfer.backend.engine.spec.state import SpecState

    class S:
        spec = SpecState(NgramIndex(2, 4), accepted=acceptance * 10, tried=10.0, last_verify=last_verify)
    return S()


def test_plan_places_draft_tokens_only_where_they_raise_tokens_per_second():
    from edgeinfer.backend.engine.spec.policy import plan

    policy = SpecPolicy(num_tokens=8, margin=1.0)    # the bare rule: a draft token must raise tokens/s at all
    d = list(range(8))
    cost = (2.0, 1.0, 1.0)     # fixed part = 2 rows: the default model on this CPU (6.8 ms / row, 2.3 ms per extra)
    # batch 1: a draft token pays from a > 1/3; a 0.9 copier gets several, a 0.3 one none
    assert plan([(_seq_with(0.9), d)], policy, 101, 1, 0, cost)[0] >= 4
    assert plan([(_seq_with(0.3), d)], policy, 101, 1, 0, cost) == [0]
    # batch 32: the same 0.9 copier does not pay; a 0.97 one still does
    assert plan([(_seq_with(0.9), d)], policy, 101, 32, 0, cost) == [0]
    assert plan([(_seq_with(0.97), d)], policy, 101, 32, 0, cost)[0] >= 1
    # draft tokens go to the sequences most likely to accept them first
    ks = plan([(_seq_with(0.5), d), (_seq_with(0.95), d)], policy, 101, 2, 0, cost)
    assert ks[1] > ks[0]
    # a sequence that has not verified for retry_every steps gets one token to learn from, whatever its estimate
    assert plan([(_seq_with(0.1, last_verify=0), d)], policy, 100, 1, 0, cost) == [1]
    assert plan([(_seq_with(0.1), d)], SpecPolicy(adaptive=False), 101, 1, 0, cost) == [8]
    # the default margin (1.5: a verify's costs beyond its rows, measured): 0.45 drafts under the bare rule only
    assert plan([(_seq_with(0.45), d)], policy, 101, 1, 0, cost)[0] >= 1
    assert plan([(_seq_with(0.45), d)], SpecPolicy(num_tokens=8), 101, 1, 0, cost) == [0]


def test_adaptive_drafting_costs_fewer_rows_than_drafting_everything(tiny):
    _, eager = run(tiny, [copy_prompt(3), prompt(50, 60)], 60, speculative="ngram", spec_adaptive=False)
    plain, _ = run(tiny, [copy_prompt(3), prompt(50, 60)], 60, speculative="off")
    got, adaptive = run(tiny, [copy_prompt(3), prompt(50, 60)], 60, speculative="ngram")
    assert got == plain
    assert adaptive.speculation.stats.drafted < eager.speculation.stats.drafted
    assert adaptive.speculation.stats.accepted / max(adaptive.speculation.stats.drafted, 1) >= eager.speculation.stats.accepted / eager.speculation.stats.drafted


def test_the_counters_reach_the_metrics(tiny):
    prompts = [copy_prompt(5)]
    _, eng = run(tiny, prompts, 30, speculative="ngram", spec_adaptive=False)
    m = BackendMetrics("tiny")
    m.on_step(eng, None, 0.0)
    text = m.render(False).decode()
    assert f'edgeinfer_backend_spec_drafted_tokens_total{{model="tiny"}} {float(eng.speculation.stats.drafted)}' in text
    assert f'edgeinfer_backend_spec_accepted_tokens_total{{model="tiny"}} {float(eng.speculation.stats.accepted)}' in text


def test_bad_settings_are_named():
    from edgeinfer.backend.engine.engine_config import EngineConfig

    for kw, name in (({"speculative": "eagle"}, "speculative="), ({"spec_tokens": 0}, "spec_tokens="),
                     ({"spec_max_batch": -1}, "spec_max_batch=")):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**kw)


# ---- sampling: rejection sampling keeps the target distribution
class _Seq:
    def __init__(self, sp: SamplingParams, seed: int) -> None:
        self.sampling = sp
        self.request_id = "chi"
        self.generator = torch.Generator().manual_seed(seed)


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> bool:
    """Pearson's chi-square over the cells with expected count >= 5 (the rest pooled), at p = 0.001."""
    from scipy.stats import chi2

    exp = probs * draws
    big = exp >= 5
    obs_cells = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp_cells = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    keep = exp_cells > 0
    assert int(keep.sum()) >= 3, "too few cells for the test"
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    return stat < chi2.ppf(0.999, int(keep.sum()) - 1)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.2), SamplingParams(temperature=0.3, top_k=20),
                                SamplingParams(temperature=0.25, top_p=0.9)])
def test_rejection_sampling_keeps_the_target_distribution(tiny, sp):
    """Logits rows from the tiny model (flat: its top token has ~1 % at temperature 1, hence the low temperatures);
    the draft is the second most likely token at row 0 and the most likely at row 1, so both branches (accept,
    reject + residual) are taken often."""
    from edgeinfer.backend.engine.spec.verify import target_probs as _probs

    eng = engine(tiny, kv_dtype="fp32", num_pages=16)
    s = Stepper(eng)
    s.add("x", prompt(9, 20), 3)
    s.run()
    ids = prompt(9, 20) + s.tokens["x"]
    with torch.no_grad():
        logits = _all_logits(tiny, ids)
    rows = logits[-3:]
    p0 = _probs(_Seq(sp, 0), rows[0])
    d0 = int(p0.argsort(descending=True)[1])
    p1 = _probs(_Seq(sp, 0), rows[1])
    d1 = int(p1.argmax())
    draws = 20_000
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    seq = _Seq(sp, 1234)
    accepted_first = 0
    for _ in range(draws):
        out, n = verify(seq, [d0, d1], rows)
        first[out[0]] += 1
        if out[0] == d0:
            accepted_first += 1
            second[out[1]] += 1
    assert _chi2_ok(first, p0, draws)
    assert _chi2_ok(second, p1, accepted_first)   # given d0 was emitted, the next token is distributed as p1
    assert 0.05 * draws < accepted_first < 0.95 * draws


def _all_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids` from one chunk on a fresh fp32 engine: the sequence holds ids[0], and a
    verify chunk [ids[0], ids[1:]] returns a row per position (row i: the model's logits after ids[:i + 1])."""
    from edgeinfer.backend.engine.scheduler import ScheduledBatch

    eng = engine(model, kv_dtype="fp32", num_pages=16, speculative="off", max_num_batched_tokens=512)
    seq = Stepper(eng).add("all", ids[:1], 1)
    assert eng.scheduler._admit(seq, 512, ScheduledBatch())
    eng.scheduler.waiting.remove(seq)
    assert eng.blocks.ensure_capacity(seq, len(ids))
    return eng.runner.execute(ScheduledBatch(verifies=[(seq, ids[1:])])).verify_logits[0]


def test_a_seeded_sampled_request_does_not_draft():
    """The same seed gives the same text twice whatever the batch: drafting would change how its random numbers
    are drawn; greedy and unseeded sampling draft."""
    from edgeinfer.protocol.wire import SamplingParams as SP

    class S:
        matcher = None

        def __init__(self, sp) -> None:
            self.sampling = sp

    assert not eligible(S(SP(temperature=0.8, seed=7)))
    assert eligible(S(SP(temperature=0.8))) and eligible(S(SP(temperature=0, seed=7)))
