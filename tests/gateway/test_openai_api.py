"""The gateway driven by the official openai client (sync and async, streaming and not) over loopback."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.gateway.conftest import MODEL, aclient, client
from tests.gateway.stub_backend import PHRASE

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def test_chat_sync_non_streaming(harness):
    stub = harness.stub()
    gw = harness.gateway([stub])
    r = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=9)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == PHRASE[:9]
    assert r.choices[0].finish_reason == "length"
    prompt = harness.tokenizer.encode_chat(MSGS)
    assert stub.requests[0].prompt_token_ids == prompt
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 9
    assert r.usage.total_tokens == len(prompt) + 9
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert stub.requests[0].cache_namespace == "tenant:demo"


def test_chat_sync_streaming_with_usage(harness):
    gw = harness.gateway([harness.stub()])
    chunks = list(client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, stream=True,
                                                     stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == PHRASE[:12]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(harness):
    gw = harness.gateway([harness.stub()])
    chunks = list(client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


async def test_chat_async_streaming_and_not(harness):
    gw = harness.gateway([harness.stub()])
    c = aclient(gw)
    r = await c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
    assert r.choices[0].message.content == PHRASE[:4]
    stream = await c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, stream=True)
    parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
    assert "".join(parts) == PHRASE[:6]
    await c.close()


def test_n_choices_fan_out(harness):
    stub = harness.stub()
    gw = harness.gateway([stub])
    r = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, n=3, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content == PHRASE[:3] for c in r.choices)
    assert r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens == len(harness.tokenizer.encode_chat(MSGS))  # counted once
    assert sorted(q.sampling.seed for q in stub.requests) == [7, 8, 9]
    assert len({q.request_id for q in stub.requests}) == 3
    chunks = list(client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, n=2, stream=True))
    by_index: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    assert by_index == {0: PHRASE[:3], 1: PHRASE[:3]}


def test_sampling_fields_reach_the_backend(harness):
    stub = harness.stub()
    gw = harness.gateway([stub])
    client(gw).chat.completions.create(
        model=MODEL, messages=MSGS, max_completion_tokens=5, temperature=0.5, top_p=0.9, presence_penalty=0.1,
        frequency_penalty=0.2, seed=3, stop=["zzz"], user="u1",
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    sp = stub.requests[0].sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (5, 0.5, 0.9, 40, 0.05)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.1, 0.1, 0.2)
    assert sp.seed == 3 and sp.stop == ["zzz"]


def test_stop_string(harness):
    gw = harness.gateway([harness.stub()])
    r = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=30, stop="brown")
    assert r.choices[0].finish_reason == "stop"
    assert "brown" not in r.choices[0].message.content


def test_chat_logprobs(harness):
    gw = harness.gateway([harness.stub()])
    r = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == list(PHRASE[:3])
    assert content[0].logprob == -0.25 and len(content[0].top_logprobs) == 2
    assert content[0].top_logprobs[1].token == "x" and content[0].bytes == list(b"T")


def test_completions_text_tokens_and_batches(harness):
    stub = harness.stub()
    gw = harness.gateway([stub])
    c = client(gw)
    r = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, logprobs=1)
    assert r.object == "text_completion" and r.choices[0].text == PHRASE[:4]
    assert r.choices[0].logprobs.tokens == list(PHRASE[:4]) and r.choices[0].logprobs.text_offset == [0, 1, 2, 3]
    assert stub.requests[-1].prompt_token_ids == harness.tokenizer.encode("Once upon")
    r = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
    assert stub.requests[-1].prompt_token_ids == [5, 6, 7] and r.usage.prompt_tokens == 3
    r = c.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=2, n=2)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 3 + 5
    text = "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                                                     stream=True) if ch.choices)
    assert text == PHRASE[:5]


def test_default_max_tokens_for_completions_is_16(harness):
    stub = harness.stub()
    gw = harness.gateway([stub])
    client(gw).completions.create(model=MODEL, prompt="hi")
    assert stub.requests[0].sampling.max_tokens == 16


def test_models_list_filters_by_tenant(harness):
    gw = harness.gateway([harness.stub()])
    assert [m.id for m in client(gw).models.list().data] == [MODEL]


def test_request_id_echoed_and_openapi(harness):
    gw = harness.gateway([harness.stub()])
    r = requests.post(gw.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-edgeinfer-demo",
                                                             "x-request-id": "my-req-42"},
                   json={"model": MODEL, "messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-req-42"
    doc = requests.get(gw.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(doc["paths"])
    assert "ChatCompletionRequest" in doc["components"]["schemas"]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_key_is_401(harness, stream):
    gw = harness.gateway([harness.stub()])
    with pytest.raises(openai.AuthenticationError) as e:
        client(gw, key="sk-wrong").chat.completions.create(model=MODEL, messages=MSGS, stream=stream)
    assert e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(gw, key="sk-wrong").models.list()
