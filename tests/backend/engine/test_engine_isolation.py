"""One sequence's failure ends that sequence only (issue 14, item 1): the poison sampling values next to a
greedy victim, a sampling failure injected into one sequence, and a forward pass that fails whenever one
request is in the batch (the engine finds it by running the suspects alone)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

_ids = itertools.count()
VICTIMS = [[17, 4032, 311, 2713, 9, 88], [640, 22, 3100, 57, 1204, 8, 19, 731], [9000, 12, 44]]
POISON = [{"top_p": 1e-46}, {"temperature": 1e-40}, {"repetition_penalty": 1e-40}]


def make_engine(model, tok) -> LLMEngine:
    eng = LLMEngine(model, tok, EngineConfig(enable_prefix_cache=False, num_pages=64))
    eng.start()
    return eng


async def run(eng: LLMEngine, prompt: list[int], rid: str = "", started: asyncio.Event | None = None, **sp):
    req = GenerateRequest(rid or f"iso-{next(_ids)}", prompt, SamplingParams(**sp), "t")
    toks, chunks = [], []
    async for c in eng.generate(req):
        toks += c.token_ids
        chunks.append(c)
        if started is not None:
            started.set()
    return toks, chunks[-1]


def greedy(prompt: list[int], **kw):
    return {"max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def alone(smol_model, smol_tokenizer):
    eng = make_engine(smol_model, smol_tokenizer)
    try:
        async def go():
            return [(await run(eng, p, **greedy(p)))[0] for p in VICTIMS]
        return asyncio.run(go())
    finally:
        eng.stop()


async def victims_with(eng: LLMEngine, intruder):
    """The victims start; once they decode, the intruder joins their batch."""
    started = asyncio.Event()
    tasks = [asyncio.ensure_future(run(eng, p, started=started, **greedy(p))) for p in VICTIMS]
    await started.wait()
    bad = await intruder()
    return [await t for t in tasks], bad


@pytest.mark.parametrize("poison", POISON, ids=[next(iter(p)) for p in POISON])
async def test_poison_sampling_value_next_to_victims(smol_model, smol_tokenizer, alone, poison):
    eng = make_engine(smol_model, smol_tokenizer)
    try:
        res, (toks, last) = await victims_with(eng, lambda: run(eng, [1, 2, 3, 4, 5], max_tokens=8, seed=7,
                                                                 ignore_eos=True, **poison))
        assert [r[0] for r in res] == alone
        assert all(r[1].finish_reason == "length" and r[1].error is None for r in res)
        assert last.finish_reason == "length" and last.error is None, last   # the poison gets valid samples
        assert len(toks) == 8 and all(0 <= t < smol_model.cfg.vocab_size for t in toks)
        assert eng.blocks.num_used == 0
    finally:
        eng.stop()


async def test_sampling_failure_of_one_sequence_ends_only_it(smol_model, smol_tokenizer, alone, monkeypatch):
    """A fault inside one sequence's sampling (injected into the top-k/top-p filter, which only the
    sampled request reaches) is that request's error; the greedy victims are untouched."""
    from edgeinfer.backend.engine import sampler

    real = sampler.filter_logits

    def broken(logits, top_k, *a):
        if top_k == 13:
            raise RuntimeError("injected sampling fault")
        return real(logits, top_k, *a)

    monkeypatch.setattr(sampler, "filter_logits", broken)
    eng = make_engine(smol_model, smol_tokenizer)
    try:
        res, (toks, last) = await victims_with(eng, lambda: run(eng, [1, 2, 3], max_tokens=8, top_k=13))
        assert [r[0] for r in res] == alone
        assert all(r[1].finish_reason == "length" for r in res)
        assert last.finish_reason == "error" and "injected sampling fault" in last.error and toks == []
        assert last.error_code == 500          # the request failed on a healthy node: not retried elsewhere
        assert eng.blocks.num_used == 0
    finally:
        eng.stop()


async def test_forward_failure_is_pinned_on_its_request(smol_model, smol_tokenizer, alone, monkeypatch):
    """The forward pass raises whenever request 'culprit' is in the batch: the victims (decoding when it
    joins) are recomputed and finish with their tokens alone; only the culprit ends with an error."""
    eng = make_engine(smol_model, smol_tokenizer)
    real = eng.runner.execute
    failed_batches = []

    def execute(batch):
        ids = {s.request_id for s in [*batch.decodes, *(s for s, _ in batch.prefills)]}
        if "culprit" in ids:
            failed_batches.append(len(ids))
            raise RuntimeError("injected forward fault")
        return real(batch)

    monkeypatch.setattr(eng.runner, "execute", execute)
    try:
        res, (toks, last) = await victims_with(eng, lambda: run(eng, [1, 2, 3], "culprit", max_tokens=8))
        assert [r[0] for r in res] == alone
        assert all(r[1].finish_reason == "length" and r[1].error is None for r in res)
        assert last.finish_reason == "error" and "injected forward fault" in last.error
        assert last.error_code == 500
        assert failed_batches[0] == 1 + len(VICTIMS) and failed_batches[-1] == 1   # in the batch, then alone
        assert eng.blocks.num_used == 0
        again, end = await run(eng, VICTIMS[0], **greedy(VICTIMS[0]))     # and the engine keeps serving
        assert again == alone[0] and end.finish_reason == "length"
    finally:
        eng.stop()


async def test_a_forward_that_fails_for_everyone_is_a_node_fault(smol_model, smol_tokenizer, monkeypatch):
    """Every suspect fails alone too: the node is at fault, so the error says 503 (the gateway may
    retry the requests on another node and marks this one down)."""
    eng = make_engine(smol_model, smol_tokenizer)

    def execute(batch):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.runner, "execute", execute)
    try:
        res = await asyncio.gather(*(run(eng, p, **greedy(p)) for p in VICTIMS[:2]))
        assert all(r[1].finish_reason == "error" and r[1].error_code == 503 and "device lost" in r[1].error
                   for r in res)
        assert eng.blocks.num_used == 0
    finally:
        eng.stop()


async def test_a_failure_while_isolating_ends_every_request_instead_of_hanging(smol_model, smol_tokenizer,
                                                                             monkeypatch):
    """The recovery itself fails (here: giving back pages raises, as a corrupted reference count does): every
    request ends with a 503 error chunk within the timeout, none hangs, and the engine thread serves on."""
    from edgeinfer.backend.engine import core as engine_mod  # the step loop, where isolate is called

    eng = make_engine(smol_model, smol_tokenizer)

    def execute(batch):
        raise RuntimeError("device lost")

    def isolate(engine, error):
        raise RuntimeError("page 3 released more often than acquired")

    monkeypatch.setattr(eng.runner, "execute", execute)
    monkeypatch.setattr(engine_mod, "isolate", isolate)
    try:
        async with asyncio.timeout(60):
            res = await asyncio.gather(*(run(eng, p, **greedy(p)) for p in VICTIMS[:2]))
        assert all(r[1].finish_reason == "error" and r[1].error_code == 503 and "retry elsewhere" in r[1].error
                   for r in res)
        monkeypatch.undo()
        async with asyncio.timeout(60):
            again, end = await run(eng, VICTIMS[0], **greedy(VICTIMS[0]))
        assert end.finish_reason == "length" and len(again) == 12
    finally:
        eng.stop()
