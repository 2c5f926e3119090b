"""Engine correctness under concurrency: batch invariance, preemption, prefix cache, abort accounting, sampling."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from edgeinfer.backend.engine.engine import LLMEngine, RequestError
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

_ids = itertools.count()


def make_engine(model, tok, **cfg) -> LLMEngine:
    eng = LLMEngine(model, tok, EngineConfig(**cfg))
    eng.start()
    return eng


async def run(eng: LLMEngine, prompt: list[int], ns: str = "t", **sp):
    sp.setdefault("temperature", 0)
    req = GenerateRequest(f"req-{next(_ids)}", prompt, SamplingParams(**sp), ns)
    toks, text, last = [], "", None
    async for c in eng.generate(req):
        toks += c.token_ids
        text += c.text
        last = c
    return toks, text, last


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49000, (5 + 17 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def alone_results(smol_model, smol_tokenizer):
    eng = make_engine(smol_model, smol_tokenizer, enable_prefix_cache=False)
    try:
        async def go():
            return [(await run(eng, p, max_tokens=16, ignore_eos=True))[0] for p in prompts(16)]
        return asyncio.run(go())
    finally:
        eng.stop()


@pytest.mark.parametrize("num_pages", [None, 36], ids=["ample-pages", "forced-preemption"])
async def test_16_concurrent_greedy_match_alone(smol_model, smol_tokenizer, alone_results, num_pages):
    eng = make_engine(smol_model, smol_tokenizer, num_pages=num_pages, max_num_batched_tokens=128,
                      enable_prefix_cache=False)
    try:
        res = await asyncio.gather(*[run(eng, p, max_tokens=16, ignore_eos=True) for p in prompts(16)])
        assert [r[0] for r in res] == alone_results
        assert all(r[2].finish_reason == "length" and r[2].usage.completion_tokens == 16 for r in res)
        if num_pages is not None:
            assert eng.scheduler.num_preemptions > 0
        assert eng.blocks.num_used == 0
    finally:
        eng.stop()


async def test_shared_prefix_is_served_from_cache(smol_model, smol_tokenizer):
    eng = make_engine(smol_model, smol_tokenizer)
    try:
        g = torch.Generator().manual_seed(7)
        prefix = torch.randint(100, 49000, (256,), generator=g).tolist()
        a = prefix + torch.randint(100, 49000, (20,), generator=g).tolist()
        b = prefix + torch.randint(100, 49000, (23,), generator=g).tolist()
        await run(eng, a, ns="tenant-1", max_tokens=4)
        warm = await run(eng, b, ns="tenant-1", max_tokens=12, ignore_eos=True)
        cold = await run(eng, b, ns="tenant-2", max_tokens=12, ignore_eos=True)   # other namespace: no hit
        assert warm[2].usage.cached_tokens >= 256
        assert cold[2].usage.cached_tokens == 0
        assert warm[0] == cold[0]
    finally:
        eng.stop()


async def test_abort_frees_pages_and_cycles_do_not_leak(smol_model, smol_tokenizer):
    eng = make_engine(smol_model, smol_tokenizer, num_pages=64)
    try:
        start_used, start_free = eng.blocks.num_used, eng.blocks.num_free
        for i in range(100):
            req = GenerateRequest(f"abort-{i}", prompts(1, seed=i)[0] * 3, SamplingParams(max_tokens=50,
                                                                                         temperature=0), "t")
            gen = eng.generate(req)
            if i % 2:
                await gen.__anext__()          # got a token, then the client goes away
            await gen.aclose()
        await asyncio.sleep(0.2)
        await eng.call_in_engine(lambda: None)   # all queued aborts have been processed
        assert eng.blocks.num_used == start_used
        assert eng.blocks.num_free == start_free
        assert all(r == 0 for r in eng.blocks.ref)
        assert not eng.scheduler.running and not eng.scheduler.waiting
    finally:
        eng.stop()


async def test_sampling_seed_stop_and_logprobs(smol_model, smol_tokenizer):
    eng = make_engine(smol_model, smol_tokenizer)
    try:
        p = smol_tokenizer.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
        s1 = await run(eng, p, temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
        s2 = await run(eng, p, temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
        s3 = await run(eng, p, temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=20)
        assert s1[0] == s2[0]
        assert s1[0] != s3[0]
        greedy = await run(eng, p, max_tokens=20)
        topk1 = await run(eng, p, temperature=1.0, top_k=1, seed=5, max_tokens=20)
        assert greedy[0] == topk1[0]
        # stop string: text stops right before it, even though it may span tokens
        full = greedy[1]
        word = full.split()[3]
        stopped = await run(eng, p, max_tokens=20, stop=[word])
        assert stopped[2].finish_reason == "stop"
        assert stopped[1] == full[: full.index(word)]
        # stop token ids
        st = await run(eng, p, max_tokens=20, stop_token_ids=[greedy[0][2]])
        assert st[0] == greedy[0][:3] and st[2].finish_reason == "stop"
        # logprobs of chosen tokens
        lp = await run(eng, p, max_tokens=5, logprobs=True, top_logprobs=3)
        req = GenerateRequest("lp", p, SamplingParams(max_tokens=5, temperature=0, logprobs=True, top_logprobs=3), "t")
        chunks = [c async for c in eng.generate(req)]
        lps = [x for c in chunks for x in (c.logprobs or [])]
        assert [x.token_id for x in lps] == lp[0]
        assert all(x.logprob <= 0 and x.top[0][0] == x.token_id for x in lps)
        # repetition/presence/frequency penalties change greedy output on a repetitive prompt
        rep = smol_tokenizer.encode("the the the the the the the the the the")
        plain = await run(eng, rep, max_tokens=8, ignore_eos=True)
        pen = await run(eng, rep, max_tokens=8, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=1.0,
                        presence_penalty=1.0)
        assert plain[0] != pen[0]
        # min_p=1.0 keeps only the argmax: same as greedy
        mp = await run(eng, p, temperature=1.0, min_p=1.0, seed=3, max_tokens=10)
        assert mp[0] == greedy[0][:10]
    finally:
        eng.stop()


async def test_eos_stops_and_usage_counts(smol_model, smol_tokenizer):
    eng = make_engine(smol_model, smol_tokenizer)
    try:
        p = smol_tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        toks, text, last = await run(eng, p, max_tokens=40)
        assert "Paris" in text
        assert last.finish_reason == "stop" and toks[-1] in smol_tokenizer.eos_token_ids
        assert last.usage.prompt_tokens == len(p) and last.usage.completion_tokens == len(toks)
    finally:
        eng.stop()


def test_bad_requests_are_rejected_with_clear_errors(smol_model, smol_tokenizer):
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=8))
    ok = SamplingParams()
    cases = [
        (GenerateRequest("a", [], ok, "t"), "empty"),
        (GenerateRequest("b", [1] * 200, ok, "t"), "needs 13 KV pages; the KV cache has 8 pages"),
        (GenerateRequest("c", [10 ** 9], ok, "t"), "out of range"),
        (GenerateRequest("d", [1], SamplingParams(temperature=-1), "t"), "temperature=-1"),
        (GenerateRequest("e", [1], SamplingParams(top_p=float("nan")), "t"), "top_p=nan"),
        (GenerateRequest("f", [1], SamplingParams(max_tokens=0), "t"), "max_tokens=0"),
        (GenerateRequest("g", [1], ok, ""), "cache_namespace"),
    ]
    for req, msg in cases:
        with pytest.raises(RequestError, match=msg.replace("(", r"\(")):
            eng.validate(req)
    with pytest.raises(ValueError, match="kv_dtype='int3'"):
        EngineConfig(kv_dtype="int3")


async def test_failed_step_is_retried_then_fails_only_a_request_that_fails_alone(smol_model, smol_tokenizer,
                                                                                  monkeypatch):
    eng = make_engine(smol_model, smol_tokenizer, num_pages=64)
    try:
        alone, _, _ = await run(eng, [5, 6, 7, 8], max_tokens=4, ignore_eos=True)
        real = eng.runner.execute
        calls = {"n": 0}

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 1 or any(s.request_id == "boom" for s, _ in batch.prefills):
                raise RuntimeError("injected step failure")
            return real(batch)

        monkeypatch.setattr(eng.runner, "execute", flaky)
        toks, _, last = await run(eng, [5, 6, 7, 8], max_tokens=4, ignore_eos=True)   # a transient failure
        assert last.finish_reason == "length" and toks == alone
        req = GenerateRequest("boom", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0), "t")
        chunks = [c async for c in eng.generate(req)]
        assert chunks[-1].finish_reason == "error" and "injected step failure" in chunks[-1].error
        toks, _, last = await run(eng, [5, 6, 7, 8], max_tokens=4, ignore_eos=True)
        assert last.finish_reason == "length" and toks == alone
        assert eng.blocks.num_used == 0
    finally:
        eng.stop()
