"""Prompt logprobs (SamplingParams.prompt_logprobs: completions' echo + logprobs, how evaluators score a prompt's
log-likelihood), from the prefill's own logits: against transformers' log-softmax at every position, the same for a
cold prefill, a chunked one and a repeat whose pages are cached, the first token's entry None."""

from __future__ import annotations

import itertools

import pytest
import torch

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow    # loads SmolLM2 and transformers
_ids = itertools.count()


async def prompt_lps(eng: LLMEngine, prompt: list[int], k: int = 2, max_tokens: int = 1):
    req = GenerateRequest(f"pl-{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                      prompt_logprobs=k), "t")
    chunks = [c async for c in eng.generate(req)]
    with_lps = [c for c in chunks if c.prompt_logprobs is not None]
    assert len(with_lps) == 1 and chunks[0].prompt_logprobs is not None      # whole, once, in the first chunk
    return chunks[0].prompt_logprobs, chunks[-1]


@pytest.fixture(scope="module")
def text_ids(smol_tokenizer):
    text = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small tin of oil and "
            "a cloth for the lamp. Ships passing the headland counted on its beam, and in forty years it had never "
            "once gone dark. ") * 3
    return smol_tokenizer.encode(text)


async def test_prompt_logprobs_match_transformers_and_every_path(smol_model, smol_tokenizer, hf_smol, text_ids):
    ids = text_ids[:150]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(kv_dtype="fp32", max_num_batched_tokens=64))
    eng.start()
    try:
        cold, last = await prompt_lps(eng, ids)          # three prefill chunks of 64
        assert cold[0] is None and len(cold) == len(ids)
        got = [e.logprob for e in cold[1:]]
        assert [e.token_id for e in cold[1:]] == ids[1:]
        diff = max(abs(a - b) for a, b in zip(got, want))
        print(f"prompt logprobs vs transformers, max abs diff over {len(want)} positions: {diff:.2e}")
        assert diff < 2e-3
        for e in cold[1:]:                                # the top-2 are the two largest, the chosen within them
            assert len(e.top) == 2 and e.top[0][1] >= e.top[1][1]
            assert e.logprob <= e.top[0][1] + 1e-6
        assert last.usage.completion_tokens == 1 and last.usage.prompt_tokens == len(ids)
        for _ in range(2):                                # the prompt's pages are in the prefix cache now
            plain = GenerateRequest(f"warm-{next(_ids)}", ids, SamplingParams(max_tokens=1, temperature=0), "t")
            out = [c async for c in eng.generate(plain)]
        assert out[-1].usage.cached_tokens >= 128
        warm, last = await prompt_lps(eng, ids)
        assert [e.logprob for e in warm[1:]] == pytest.approx(got, abs=1e-5)
        assert last.usage.cached_tokens == 0             # computed, not served from the cache
        short, _ = await prompt_lps(eng, ids[:1], k=0)
        assert short == [None]
    finally:
        eng.stop()
