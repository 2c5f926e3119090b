"""`edgeinfer serve --model DIR` on tiny GLM-4.5 (MoE, GQA) and DeepSeek-V3 (MoE, MLA over latent pages)
checkpoints (transformers' own classes, random weights, the default model's tokenizer), as a user runs it: from
another directory, with its embedded valkey, through the real `openai` client: a chat answer equal to
transformers' greedy tokens, a stream, a structured output, and the prompt's pages from the prefix cache."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.gateway.conftest import DEMO_KEY
from tests.support import moe_checkpoints
from tests.support.serve import Serve

pytestmark = [pytest.mark.slow, pytest.mark.e2e]   # e2e: claims through the public API (a real stack)
NAMES = {"glm4_moe": "tiny-glm45-moe", "deepseek_v3": "tiny-deepseek-v3"}
LONG = [{"role": "user", "content": "Tell me everything you know about the history of the city of Paris, "
                                    "its rivers, its bridges and its museums, in as much detail as you can."}]


@pytest.fixture(scope="module", params=list(NAMES))
def served(request, smol_dir, tmp_path_factory):
    name = NAMES[request.param]
    model_dir = tmp_path_factory.mktemp("models") / name
    model_dir.mkdir()
    hf = moe_checkpoints.servable(request.param, model_dir, smol_dir, max_position_embeddings=2048)
    home = tmp_path_factory.mktemp("moe-home")
    # fp32 KV: the oracle is transformers' fp32 greedy tokens, and a random tiny model's near-ties flip under
    # fp8 KV's rounding (the served default, fp8, is measured in benchmarks quality.fp8_kv)
    s = Serve(home, tmp_path_factory.mktemp("elsewhere"), "--model", str(model_dir), "--backend-arg=--kv-dtype",
              "--backend-arg=fp32")
    try:
        s.wait_for("ready:")
        yield s, hf, name
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(served):
    s, _, _ = served
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key=DEMO_KEY, max_retries=0)


@pytest.fixture(scope="module")
def NAME(served):   # noqa: N802 (the served model's name, as the tests below use it)
    return served[2]


def test_chat_answers_with_transformers_tokens_and_the_second_ask_hits_the_cache(served, client, smol_dir, NAME):
    from edgeinfer.protocol.tokenizer import Tokenizer

    _, hf, _ = served
    a = client.chat.completions.create(model=NAME, messages=LONG, temperature=0, max_tokens=12)
    b = client.chat.completions.create(model=NAME, messages=LONG, temperature=0, max_tokens=12)
    assert a.model == NAME and a.usage.completion_tokens == 12 and a.choices[0].finish_reason == "length"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens >= 32
    tok = Tokenizer.from_dir(smol_dir)
    ids = tok.encode_chat(LONG)
    assert len(ids) == a.usage.prompt_tokens
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(ids):].tolist()
    assert a.choices[0].message.content == tok.decode(want)


def test_stream_gives_the_same_text(client, NAME):
    whole = client.chat.completions.create(model=NAME, messages=LONG, temperature=0, max_tokens=10)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=LONG, temperature=0, max_tokens=10, stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].message.content


def test_structured_output_is_valid_json_from_a_random_moe(client, NAME):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Is Paris in France?"}],
                                       temperature=0, max_tokens=32,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no")
