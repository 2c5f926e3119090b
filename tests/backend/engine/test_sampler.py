"""The sampler is numerically safe for every value SamplingParams.validate admits: property tests
(hypothesis) over the admitted range, the three poison values of issue 14, and per-sequence isolation of a
row that cannot be sampled (NaN logits)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgeinfer.backend.engine.sampler import make_generator, sample
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.protocol.page_id import PageKeyContext
from edgeinfer.protocol.wire import SamplingParams

CTX = PageKeyContext(b"seed", "ns", "fp", "fp32", 16)
POISON = {"top_p": 1e-46, "temperature": 1e-40, "repetition_penalty": 1e-40}


def seq(sp: SamplingParams, prompt: list[int], output: list[int], rid: str = "r") -> Sequence:
    s = Sequence(rid, prompt, sp, CTX, lambda *a, **k: None)
    s.output_ids = list(output)
    s.generator = make_generator(sp.seed) if sp.temperature > 0 else None
    return s


def tiny_floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Log-uniform plus hypothesis' own edge cases: subnormals, values that round to 0 in float32."""
    return st.one_of(
        st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=True),
        st.floats(-330, math.log10(hi) if hi > 0 else 0).map(lambda e: 10.0 ** e).filter(lambda v: lo <= v <= hi),
    )


admitted = st.builds(
    SamplingParams,
    max_tokens=st.just(16),
    temperature=st.one_of(st.just(0.0), tiny_floats(0.0, 1e300)),
    top_p=tiny_floats(5e-324, 1.0),
    top_k=st.integers(0, 80),
    min_p=st.one_of(st.just(0.0), tiny_floats(0.0, 1.0)),
    repetition_penalty=st.one_of(st.just(1.0), tiny_floats(5e-324, 1e300)),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    seed=st.integers(0, 2**64 - 1),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 20),
)

VOCAB = 64


@st.composite
def logit_rows(draw) -> torch.Tensor:
    scale = draw(st.sampled_from([1.0, 30.0, 1e4, 1e30, 3e38]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    row = (torch.rand(VOCAB, generator=g) * 2 - 1) * scale
    impossible = draw(st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB - 1, unique=True))
    row[impossible] = float("-inf")          # e.g. a padded vocabulary: never sampled
    return row


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sp=admitted, row=logit_rows(), history=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=80))
@example(sp=SamplingParams(top_p=1e-46), row=torch.linspace(-5, 5, VOCAB), history=[1, 2, 3])
@example(sp=SamplingParams(temperature=1e-40), row=torch.linspace(-5, 5, VOCAB), history=[1, 2, 3])
@example(sp=SamplingParams(repetition_penalty=1e-40), row=torch.linspace(-5, 5, VOCAB), history=[60, 61, 62])
@example(sp=SamplingParams(repetition_penalty=1e300), row=-torch.linspace(1, 5, VOCAB),
         history=list(range(VOCAB)))
@example(sp=SamplingParams(temperature=1e300, repetition_penalty=1e300), row=-torch.linspace(1, 5, VOCAB),
         history=list(range(VOCAB)))
def test_every_admitted_value_samples_a_possible_token(sp, row, history):
    sp.validate()
    s = seq(sp, history[:1], history[1:])
    got = sample([s], row.unsqueeze(0))[0]
    assert not isinstance(got, Exception), got
    tok, lp = got
    assert 0 <= tok < VOCAB and math.isfinite(row[tok].item()), (tok, row[tok].item())
    if sp.logprobs:
        assert lp is not None and lp.token_id == tok and not math.isnan(lp.logprob)


@pytest.mark.parametrize("field", sorted(POISON))
def test_poison_values_pick_the_top_token(field):
    """temperature 1e-40 and top_p 1e-46 are greedy in effect; repetition_penalty 1e-40 on tokens with
    positive logits makes them saturate (and win), never NaN."""
    row = torch.linspace(-5, 5, VOCAB)
    sp = SamplingParams(seed=1, **{field: POISON[field]})
    history = [VOCAB - 1] if field == "repetition_penalty" else [3]
    got = sample([seq(sp, history, [])], row.unsqueeze(0).clone())[0]
    assert got[0] == VOCAB - 1


def test_a_row_that_cannot_be_sampled_fails_only_its_sequence():
    from edgeinfer.backend.engine.sampler import SamplingError

    logits = torch.linspace(-5, 5, VOCAB).repeat(3, 1)
    logits[1, 7] = float("nan")
    seqs = [seq(SamplingParams(temperature=0), [1], [], "a"), seq(SamplingParams(temperature=0), [1], [], "b"),
            seq(SamplingParams(temperature=0.8, seed=3), [1], [], "c")]
    out = sample(seqs, logits)
    assert out[0][0] == VOCAB - 1 and not isinstance(out[2], Exception)
    assert isinstance(out[1], SamplingError) and "request b" in str(out[1]) and "non-finite" in str(out[1])
    logits[2, 9] = float("nan")                 # the sampled path checks its row too
    assert isinstance(sample(seqs, logits)[2], SamplingError)
