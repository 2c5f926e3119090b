"""Hardening III (issue 39), through real gateways on loopback and the openai client: one tenant's schemas
cannot freeze the gateway (caps on the loop, meta-checks in worker processes after admission), deep nesting
and grammar limits are 400s naming the field, a stalled gateway loop does not mark healthy nodes dead,
/tokenize and /detokenize go through admission and the prompt caps, /metrics shows tenant ids only to a key,
and the shutdown grace bounds a running stream, which ends with an error event.
"""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import requests

from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.errors import APIError
from edgeinfer.gateway.state import STATE
from edgeinfer.gateway.structured import SchemaLimits, check_depth, measure
from tests.gateway.conftest import DEMO_KEY, METRICS_AUTH, MODEL, OTHER_KEY, client, tenant

AUTH = {"authorization": f"Bearer {DEMO_KEY}", "content-type": "application/json"}
VICTIM = {"id": "victim", "api_key_sha256": [config_mod.hash_key(OTHER_KEY)], "models": ["*"]}


def _error(r, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def _nested_object(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _raw_nesting(depth: int) -> str:
    return "[" * depth + "]" * depth


def _chat(schema: dict) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _many_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)},
            "required": [f"p{i}" for i in range(n)]}


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": _many_properties(20)}} for i in range(n)]


# ---- the limits: unit checks of the bounded walk ----------------------------------------------------

def test_measure_names_each_limit_and_stops_at_it():
    limits = SchemaLimits(max_bytes=2000, max_depth=10, max_properties=50, max_alternatives=20, max_tools=4)
    cases = [(_nested_object(6), "max_schema_depth"),            # 6 schema levels = 13 JSON levels
             (_many_properties(51), "max_schema_properties"),
             ({"anyOf": [{"type": "string"}] * 21}, "max_schema_alternatives"),
             ({"enum": list(range(21))}, "max_schema_alternatives"),
             ({"type": "string", "description": "d" * 2000}, "max_schema_bytes")]
    for schema, setting in cases:
        with pytest.raises(APIError) as e:
            measure(schema, "response_format.json_schema.schema", limits)
        assert e.value.status == 400 and setting in e.value.message, e.value.message
        assert e.value.param == "response_format.json_schema.schema"
    measure(_many_properties(50), "p", limits)    # at the limit: accepted
    # a million properties: stopped after the first 51 (bounded work whatever the size)
    t0 = time.perf_counter()
    with pytest.raises(APIError):
        measure(_many_properties(100_000), "p", limits)
    assert time.perf_counter() - t0 < 5     # generous: the walk stops early; it is not a timing test
    with pytest.raises(APIError) as e:
        check_depth(json.loads(_raw_nesting(200)), "chat_template_kwargs", limits)
    assert e.value.param == "chat_template_kwargs"


# ---- items 2 and 3: deep nesting is a 400 naming the field, on every endpoint ----------------------

def test_deeply_nested_schemas_are_400_naming_the_field_on_every_endpoint(harness):
    stub = harness.stub()
    gw = harness.gateway([stub])
    post = lambda path, body: requests.post(gw.url + path, json=body, headers=AUTH, timeout=30)  # noqa: E731
    deep = _nested_object(100)
    _error(post("/v1/chat/completions", _chat(deep)), 400, "schema_too_large", "response_format.json_schema.schema")
    _error(post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                    "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": deep}}}),
           400, "schema_too_large", "response_format.json_schema.schema")
    _error(post("/v1/responses", {"model": MODEL, "input": "hi",
                                  "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}}),
           400, None, None)
    arrays: dict = {"type": "string"}
    for _ in range(200):
        arrays = {"type": "array", "items": arrays}
    _error(post("/v1/chat/completions", _chat(arrays)), 400, "schema_too_large")
    any_of: dict = {"type": "string"}
    for _ in range(300):
        any_of = {"anyOf": [any_of, {"type": "null"}]}
    _error(post("/v1/chat/completions", _chat(any_of)), 400, "schema_too_large")
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested_object(150)}}
    _error(post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         "tools": [tool]}), 400, "schema_too_large", "tools[0].function.parameters")
    # the openai client sees the same 400 (BadRequestError), not a 500
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": deep}})
    assert e.value.status_code == 400
    assert not stub.requests        # nothing reached the backend


@pytest.mark.parametrize("field, value", [
    ("response_format", '{"type": "json_object", "x": RAW}'),
    ("guided_json", '{"x": RAW}'),
    ("guided_json", "STRING"),                 # guided_json sent as a string holding the JSON
    ("chat_template_kwargs", '{"x": RAW}'),
])
def test_deep_raw_nesting_is_400_naming_the_field(harness, field, value):
    gw = harness.gateway([harness.stub()])
    for depth in (100, 2000, 100_000):      # under msgspec's own recursion limit, and over it
        raw = _raw_nesting(depth)
        text = json.dumps(raw) if value == "STRING" else value.replace("RAW", raw)
        data = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {text}}}'
        err = _error(requests.post(gw.url + "/v1/chat/completions", data=data, headers=AUTH, timeout=30), 400)
        assert err["param"] == field, (depth, err)


def test_deep_responses_input_items_are_400(harness):
    gw = harness.gateway([harness.stub()])
    for depth in (100, 5000):
        item = f'{{"type": "message", "role": "user", "content": "hi", "x": {_raw_nesting(depth)}}}'
        data = f'{{"model": "{MODEL}", "input": [{item}]}}'
        err = _error(requests.post(gw.url + "/v1/responses", data=data, headers=AUTH, timeout=30), 400)
        assert err["param"] == "input", err


# ---- item 1: one tenant's schemas do not freeze the gateway ----------------------------------------

def test_a_victims_stream_keeps_flowing_while_another_tenant_sends_huge_schemas(harness):
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.02
    stub.behaviour.phrase = "flowing " * 40
    gw = harness.gateway([stub], tenants=[tenant(), VICTIM], health_interval_s=0.2)
    gaps: list[float] = []
    done = threading.Event()

    def victim() -> None:
        last = None
        stream = client(gw, key=OTHER_KEY).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=300, stream=True)
        for _ in stream:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        done.set()

    attacks = [_chat(_many_properties(100_000)),                               # 2.8 MB
               _chat(_many_properties(5000)),
               _chat({"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}} for i in range(2000)]}),
               _chat(_many_properties(1000)),                                  # within the caps: checked off the loop
               {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": _tools(500)},
               {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": _tools(128),
                "tool_choice": "required"}]
    bodies = [json.dumps(body).encode() for body in attacks]   # encoded before: this process shares the GIL
    t = threading.Thread(target=victim)
    t.start()
    time.sleep(0.5)
    statuses = []
    for body in bodies:
        r = requests.post(gw.url + "/v1/chat/completions", data=body, headers=AUTH, timeout=120)
        statuses.append(r.status_code)
        h = requests.get(gw.url + "/health", timeout=5)
        assert h.status_code == 200
    t.join(timeout=120)
    assert done.is_set() and len(gaps) > 100
    assert statuses[:3] == [400, 400, 400] and statuses[4] == 400, statuses
    assert statuses[3] == 200, statuses
    assert statuses[5] == 400, statuses      # 128 tools pass the caps; their prompt is over the stub's context
    assert max(gaps) < 1.0, f"largest gap between the victim's tokens: {max(gaps):.3f} s"


def test_schema_checks_run_after_admission(harness):
    """A 3-per-minute tenant is refused (429) before any schema work once its budget is spent."""
    gw = harness.gateway([harness.stub()], tenants=[tenant(requests_per_min=3)])
    st = gw.app[STATE]
    body = _chat(_many_properties(300))
    codes = [requests.post(gw.url + "/v1/chat/completions", json={**body, "seed": i}, headers=AUTH,
                           timeout=60).status_code for i in range(6)]
    assert codes.count(429) >= 2, codes
    assert st.schemas.checks <= 3       # the refused requests' schemas were never checked


def test_a_schema_check_over_its_budget_is_400_and_the_worker_is_replaced(harness):
    gw = harness.gateway([harness.stub()], schema_check_timeout_s=0.05, max_schema_properties=5000,
                         max_schema_bytes=1 << 20)
    err = _error(requests.post(gw.url + "/v1/chat/completions", json=_chat(_many_properties(5000)), headers=AUTH,
                               timeout=60), 400, "schema_too_complex", "response_format.json_schema.schema")
    assert "schema_check_timeout_s" in err["message"]
    assert gw.app[STATE].schemas.timeouts == 1
    # the next request gets fresh workers
    gw.app[STATE].schemas.timeout_s = 30
    r = requests.post(gw.url + "/v1/chat/completions", json=_chat(_many_properties(3)), headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_invalid_schema_is_still_400_naming_its_place_and_cached(harness):
    gw = harness.gateway([harness.stub()])
    bad = {"type": "object", "properties": {"age": {"type": "integr"}}}
    for _ in range(2):
        _error(requests.post(gw.url + "/v1/chat/completions", json=_chat(bad), headers=AUTH, timeout=60), 400,
               "invalid_response_format", "response_format.json_schema.schema.properties.age.type")
    assert gw.app[STATE].schemas.checks == 1      # the second answer came from the cache


# ---- node health does not depend on the gateway's loop being free ------------------------------------

def test_a_stalled_gateway_loop_does_not_mark_healthy_nodes_dead(harness):
    stub = harness.stub()
    gw = harness.gateway([stub], health_interval_s=0.2)        # a node is stale after 0.2 + 0.5 s unanswered
    assert client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                              max_tokens=2).choices
    gw.loop.call_soon_threadsafe(time.sleep, 3.0)                # a 3 s synchronous step on the gateway's loop
    time.sleep(0.2)
    out = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b"}], max_tokens=2)
    assert out.choices[0].message.content


# ---- item 5: /tokenize and /detokenize go through admission and the prompt caps ---------------------

def test_tokenize_is_rate_limited_and_capped_like_chat(harness):
    gw = harness.gateway([harness.stub()], tenants=[tenant(requests_per_min=3, max_prompt_chars=1000)])
    codes = [requests.post(gw.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, headers=AUTH,
                           timeout=30).status_code for _ in range(8)]
    assert codes[:3] == [200, 200, 200] and set(codes[3:]) == {429}, codes
    gw2 = harness.gateway([harness.stub("node-b")], tenants=[tenant(max_prompt_chars=1000)])
    err = _error(requests.post(gw2.url + "/tokenize", json={"model": MODEL, "prompt": "x" * 1001}, headers=AUTH,
                               timeout=30), 413, "prompt_too_large", "prompt")
    assert "max_prompt_chars" in err["message"]
    _error(requests.post(gw2.url + "/tokenize", headers=AUTH, timeout=30,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "y" * 1001}]}),
           413, "prompt_too_large", "messages")
    ok = requests.post(gw2.url + "/tokenize", json={"model": MODEL, "prompt": "hi", "add_special_tokens": False},
                       headers=AUTH, timeout=30)
    assert ok.status_code == 200 and ok.json()["count"] == 2


def test_detokenize_is_rate_limited(harness):
    gw = harness.gateway([harness.stub()], tenants=[tenant(requests_per_min=2)])
    codes = [requests.post(gw.url + "/detokenize", json={"model": MODEL, "tokens": [72, 73]}, headers=AUTH,
                           timeout=30).status_code for _ in range(4)]
    assert codes == [200, 200, 429, 429], codes


# ---- item 6: the open /metrics carries no tenant ids --------------------------------------------------

def test_open_metrics_show_no_tenant_ids_and_the_metrics_key_shows_them(harness):
    gw = harness.gateway([harness.stub()], tenants=[tenant(id="alice-corp")])
    client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    open_text = requests.get(gw.url + "/metrics", timeout=5).text
    assert "alice-corp" not in open_text and "tenant=" not in open_text
    assert "edgeinfer_gateway_routing_decisions_total" in open_text      # the node-level series stay open
    keyed = requests.get(gw.url + "/metrics", headers=METRICS_AUTH, timeout=5)
    assert keyed.status_code == 200
    assert 'edgeinfer_gateway_completion_tokens_total{model="stub-model",tenant="alice-corp"} 3.0' in keyed.text
    # a tenant's own API key is not a metrics key
    _error(requests.get(gw.url + "/metrics", headers={"authorization": f"Bearer {DEMO_KEY}"}, timeout=5), 401,
           "invalid_api_key")


# ---- the shutdown grace bounds a running stream ------------------------------------------------------

def test_shutdown_grace_cuts_a_running_stream_with_an_error_event(harness):
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.1
    stub.behaviour.phrase = "slow " * 200
    gw = harness.gateway([stub], shutdown_grace_s=1.0)
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with requests.post(gw.url + "/v1/chat/completions", headers=AUTH, stream=True, timeout=60,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "go"}],
                                 "max_tokens": 500, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line.decode())
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    t0 = time.monotonic()
    gw.stop(timeout=60)
    took = time.monotonic() - t0
    t.join(timeout=30)
    assert not t.is_alive()
    assert took < 1.0 + 10, took            # the grace (1 s) bounds it; 500 tokens at 0.1 s would take 50 s
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == "shutting_down", err
    assert len(events) < 100
    assert stub.aborts or stub.disconnects     # the backend request was aborted, not left running
