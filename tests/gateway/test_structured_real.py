"""Structured outputs and tool calling end to end: the official openai client -> gateway -> a real
backend.server on SmolLM2-135M, decoding constrained by llguidance grammars."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Literal

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field

from tests.gateway.conftest import DEMO_KEY, parsed, tenant
from tests.support.backend_process import INTERNAL_AUTH, BackendProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e]   # e2e: claims through the public API (a real stack)
SEED = "structured-test-seed"


class Backend(BackendProcess):
    def __init__(self, model_dir) -> None:
        super().__init__(model_dir, "struct-a", ["--max-num-seqs", "8", "--kv-cache-bytes", str(64 << 20)], SEED)


@pytest.fixture(scope="module")
def model_dir():
    from edgeinfer.backend.model.gguf_import import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="module")
def backend(model_dir):
    b = Backend(model_dir)
    try:
        b.wait_ready()
        yield b
    finally:
        b.stop()


@pytest.fixture
def gw(harness, model_dir, backend):
    name = requests.get(backend.url + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()["model"]
    from tests.support.backend_process import INTERNAL_SECRET

    cfg = parsed({"server": {"page_seed": SEED, "health_interval_s": 0.5, "internal_secret": INTERNAL_SECRET},
                  "models": [{"name": name, "tokenizer": str(model_dir)}],
                  "nodes": [{"id": backend.node_id, "url": backend.url, "model": name}],
                  "tenants": [tenant()]})
    return harness.gateway([], cfg=cfg), name


def client(g) -> openai.OpenAI:     # generous timeout: the test machine's CPUs are shared and slow
    return openai.OpenAI(base_url=g.url + "/v1", api_key=DEMO_KEY, max_retries=0, timeout=600)


def aclient(g) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=DEMO_KEY, max_retries=0, timeout=900)


# ---- response_format ------------------------------------------------------------------------------

class Pet(BaseModel):
    name: str = Field(max_length=12)
    species: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


def test_parse_with_a_pydantic_model(gw, backend):
    g, name = gw
    c = client(g)
    forced = backend.metric("edgeinfer_backend_grammar_fast_forward_tokens_total")
    out = c.chat.completions.parse(model=name, messages=[{"role": "user", "content": "Describe my pet as JSON."}],
                                   response_format=Pet, max_tokens=60, temperature=0)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and out.choices[0].finish_reason == "stop"
    # the keys and punctuation the schema fixes were fast-forwarded (no model step each): '{"name": "', ...
    assert backend.metric("edgeinfer_backend_grammar_fast_forward_tokens_total") - forced >= 6
    free = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Describe my pet as JSON."}],
                                     max_tokens=60, temperature=0)
    with pytest.raises(ValueError):     # unconstrained, the same request is not a Pet
        Pet.model_validate_json(free.choices[0].message.content or "")


def _leaf(r: random.Random, depth: int) -> dict:
    kinds = ["string", "enum", "int", "number", "bool", "null", "const", "array", "object", "anyof"]
    if depth >= 2:
        kinds = kinds[:7]
    k = r.choice(kinds)
    if k == "string":
        return {"type": "string", "minLength": r.randint(0, 2), "maxLength": r.randint(3, 8)}
    if k == "enum":
        return {"enum": r.sample(["red", "green", "blue", "north", "south", "yes", "no", "maybe"], r.randint(2, 4))}
    if k == "int":
        lo = r.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(1, 500)}
    if k == "number":
        return {"type": "number", "minimum": 0, "maximum": r.choice([1, 10, 1000])}
    if k == "bool":
        return {"type": "boolean"}
    if k == "null":
        return {"type": ["string", "null"], "maxLength": 6}
    if k == "const":
        return {"const": r.choice(["v1", 7, True])}
    if k == "array":
        return {"type": "array", "items": _leaf(r, depth + 1), "minItems": r.randint(0, 1), "maxItems": 2}
    if k == "anyof":
        return {"anyOf": [_leaf(r, depth + 1), _leaf(r, depth + 1)]}
    return _object(r, depth + 1)


def _object(r: random.Random, depth: int) -> dict:
    keys = r.sample(["id", "name", "color", "count", "score", "tags", "meta", "ok", "kind", "size"], r.randint(1, 3))
    props = {k: _leaf(r, depth) for k in keys}
    required = [k for k in keys if r.random() < 0.7] or keys[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def fifty_schemas() -> list[dict]:
    r = random.Random(16)
    out = [_object(r, 0) for _ in range(44)]
    out += [{"type": "array", "items": _object(r, 1), "minItems": 1, "maxItems": 2},
            {"enum": ["alpha", "beta", "gamma"]},
            {"type": "integer", "minimum": 10, "maximum": 99},
            {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object",
             "properties": {"c": {"type": "boolean"}}, "required": ["c"], "additionalProperties": False}},
             "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
            {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                             "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                              "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
             "required": ["from", "to"], "additionalProperties": False},
            {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 2}]
    assert len({json.dumps(s, sort_keys=True) for s in out}) == 50
    return out


@pytest.mark.timeout(1800)     # ~50 x 40 tokens, 8 at a time: minutes on the shared 2-core test machine
def test_fifty_varied_schemas_all_validate(gw):
    g, name = gw
    schemas = fifty_schemas()

    async def one(c: openai.AsyncOpenAI, i: int, s: dict, gate: asyncio.Semaphore):
        async with gate:
            out = await c.chat.completions.create(
                model=name, messages=[{"role": "user", "content": f"Give example {i} as JSON."}], max_tokens=160,
                temperature=0.7, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}})
        return out.choices[0]

    async def go():
        c, gate = aclient(g), asyncio.Semaphore(8)
        try:
            return await asyncio.gather(*(one(c, i, s, gate) for i, s in enumerate(schemas)))
        finally:
            await c.close()

    choices = asyncio.run(go())
    bad = []
    for i, (s, ch) in enumerate(zip(schemas, choices)):
        try:
            jsonschema.validate(json.loads(ch.message.content or ""), s)
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append((i, ch.finish_reason, ch.message.content, str(e)[:120]))
    assert not bad, bad


def test_json_object_mode_on_chat_and_completions(gw):
    g, name = gw
    c = client(g)
    out = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "A JSON object about the sea"}],
                                    response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    text = out.choices[0].message.content or ""
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["n"], "additionalProperties": False}
    comp = c.completions.create(model=name, prompt="A number from 1 to 5 as JSON:", max_tokens=20, temperature=0,
                                extra_body={"response_format": {"type": "json_schema",
                                                                "json_schema": {"name": "n", "schema": schema}}})
    jsonschema.validate(json.loads(comp.choices[0].text), schema)


def test_bad_schema_is_400_naming_the_part(gw):
    g, name = gw
    c = client(g)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=msgs, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"age": {"type": "integr"}}}}})
    assert e.value.body["param"] == "response_format.json_schema.schema.properties.age.type"
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):    # valid JSON Schema, not supported
        c.chat.completions.create(model=name, messages=msgs, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}})
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        c.chat.completions.create(model=name, messages=msgs, response_format={"type": "json_schema"})
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=msgs, response_format={"type": "yaml"})
    assert e.value.body["param"] == "response_format.type"


def test_constrained_request_hits_the_prefix_cache(gw):
    g, name = gw
    c = client(g)
    long = "You answer in JSON. " * 12
    rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}
    msgs = [{"role": "system", "content": long}, {"role": "user", "content": "Is it ok?"}]
    first = c.chat.completions.create(model=name, messages=msgs, response_format=rf, max_tokens=10, temperature=0)
    second = c.chat.completions.create(model=name, messages=msgs, response_format=rf, max_tokens=10, temperature=0)
    assert json.loads(second.choices[0].message.content or "") == json.loads(first.choices[0].message.content or "")
    assert second.usage.prompt_tokens_details.cached_tokens >= 64


# ---- tools ----------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, fn: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == fn["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["function"]["parameters"])
    return args


def test_named_tool_choice_forces_that_function(gw):
    g, name = gw
    c = client(g)
    for fn in (WEATHER, TIME):
        out = c.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                        temperature=0, tool_choice={"type": "function",
                                                                    "function": {"name": fn["function"]["name"]}})
        ch = out.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        _check_call(ch.message.tool_calls[0], fn)
    req = c.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                    max_tokens=60, temperature=0, parallel_tool_calls=False)
    assert req.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
    with pytest.raises(openai.BadRequestError, match="get_nothing"):
        c.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], max_tokens=5,
                                  tool_choice={"type": "function", "function": {"name": "get_nothing"}})


def test_tool_call_round_trip(gw):
    g, name = gw
    c = client(g)
    force = {"type": "function", "function": {"name": "get_weather"}}
    out = c.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], tool_choice=force, max_tokens=60,
                                    temperature=0)
    msg = out.choices[0].message
    _check_call(msg.tool_calls[0], WEATHER)
    turn2 = [*ASK, msg.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp_c": 18, "sky": "clear"}'}]
    answer = c.chat.completions.create(model=name, messages=turn2, tools=[WEATHER], max_tokens=30, temperature=0)
    a = answer.choices[0]
    assert a.message.content or a.message.tool_calls
    assert answer.usage.prompt_tokens > out.usage.prompt_tokens     # the call and its result were rendered


def test_tool_call_round_trip_streaming(gw):
    g, name = gw
    c = client(g)
    force = {"type": "function", "function": {"name": "get_weather"}}
    calls: dict[int, dict] = {}
    reasons = []
    with c.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], tool_choice=force, max_tokens=60,
                                   temperature=0, stream=True) as stream:
        for chunk in stream:
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    cur = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                    cur["name"] += d.function.name or ""
                    cur["arguments"] += d.function.arguments or ""
                if ch.finish_reason:
                    reasons.append(ch.finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    assert calls[0]["name"] == "get_weather"
    turn2 = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function",
         "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18C and clear"}]
    text = ""
    with c.chat.completions.create(model=name, messages=turn2, tools=[WEATHER], tool_choice="none", max_tokens=20,
                                   temperature=0, stream=True) as stream:
        for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                assert not ch.delta.tool_calls
    assert text.strip()


# ---- grammar limits reached after compile (issue 39, item 4) --------------------------------------

SELF_RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "x{1000000}"}, "guided_regex"),
    ({"guided_regex": "(x{1000}){1000}"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SELF_RECURSIVE}}},
     "response_format"),
    ({"guided_choice": [f"v{i}" for i in range(10_000)]}, "guided_choice"),
])
def test_a_grammar_over_the_parsers_limits_is_400_naming_its_field(gw, extra, param, stream):
    """The request's own grammar is at fault: 400 naming the field (was 500 generation_failed), for a
    stream too (the grammar fails on the first token, before any byte is sent)."""
    g, name = gw
    with pytest.raises(openai.BadRequestError) as e:
        out = client(g).chat.completions.create(model=name, messages=[{"role": "user", "content": "Say x."}],
                                                max_tokens=8, temperature=0, stream=stream, extra_body=extra)
        if stream:
            list(out)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["code"] in ("invalid_grammar", "schema_too_large"), err
    # the node is fine: the next request is answered
    ok = client(g).chat.completions.create(model=name, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=2, temperature=0)
    assert ok.choices[0].message.content


# ---- a grammar's per-token cost (issue 53, item 6) ------------------------------------------------

COSTLY = ["((x{60}){60}){60}", "((ab{50}){50}){50}", "((x{55}){55}){55}", "((xy{40}){45}){50}",
          "((x{60}){60}){60}", "((ab{50}){50}){50}", "((x{58}){61}){59}", "((z{60}){60}){60}"]


def test_costly_grammars_do_not_stall_a_neighbours_stream(gw):
    """Eight nested-repeat regexes at once (each ~25-60 ms of mask work per token on this CPU) while another request
    streams: each is a 400 naming guided_regex before it decodes, and the neighbour's largest gap between tokens
    stays under 1 s (was 2.8 s, the masks paid inside the shared step)."""
    g, name = gw
    import threading
    import time

    gaps: list[float] = []
    started = threading.Event()

    def neighbour() -> None:
        last = None
        stream = client(g).chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Tell a long story about a ship."}], max_tokens=96,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            now = time.monotonic()
            if chunk.choices and chunk.choices[0].delta.content:
                if last is not None:
                    gaps.append(now - last)
                last = now
                started.set()

    errors: dict[str, openai.APIStatusError] = {}
    served: list[str] = []

    def attack(i: int, rx: str) -> None:
        try:
            client(g).chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=64,
                                              temperature=0, extra_body={"guided_regex": rx})
            served.append(rx)
        except openai.APIStatusError as e:
            errors[f"{i}:{rx}"] = e

    t = threading.Thread(target=neighbour)
    t.start()
    assert started.wait(120)
    attackers = [threading.Thread(target=attack, args=(i, rx)) for i, rx in enumerate(COSTLY)]
    for a in attackers:
        a.start()
    for a in attackers:
        a.join(300)
    t.join(300)
    assert len(errors) + len(served) == len(COSTLY)
    for e in errors.values():
        assert e.status_code == 400 and e.body["param"] == "guided_regex", e.body
        assert "too costly per token" in e.body["message"], e.body
    assert {k for k in errors if "((x{60}){60}){60}" in k} == {"0:((x{60}){60}){60}", "4:((x{60}){60}){60}"}
    print(f"refused {len(errors)}, served {served}; neighbour's largest gap {max(gaps):.3f} s, "
          f"median {sorted(gaps)[len(gaps) // 2]:.3f} s")
    assert len(gaps) > 40 and max(gaps) < 1.0, f"largest gap {max(gaps):.2f} s"


def test_cheap_regexes_pass_the_budget(gw):
    g, name = gw
    out = client(g).chat.completions.create(model=name, messages=[{"role": "user", "content": "A number?"}],
                                            max_tokens=8, temperature=0, extra_body={"guided_regex": "[0-9]{1,4}"})
    assert out.choices[0].message.content.isdigit()


def test_integrity_counters_are_exported_at_zero_from_the_start(backend):
    """Issue 53, item 9: an alert on kv_integrity_failures_total{where} can be written before the first failure."""
    text = requests.get(backend.url + "/metrics", timeout=5).text
    for where in ("step", "prefix_hit", "store_receive", "swap_in", "handoff_send", "handoff_receive"):
        assert 'edgeinfer_backend_kv_integrity_failures_total{model="' in text
        assert f'where="{where}"}} 0.0' in text, where
    assert 'edgeinfer_backend_integrity_failures_total{model="' in text and 'source="redis"} 0.0' in text
