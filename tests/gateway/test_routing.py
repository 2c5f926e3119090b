"""Routing by cached prefix / load / session affinity, retry before the first byte, mid-stream failure,
client disconnect -> backend abort, graceful shutdown, key rotation by reload, metrics and access log."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import openai
import pytest
import requests

from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.nodes import Node
from edgeinfer.gateway.routing import affinity_node
from tests.conftest import wait_until
from tests.gateway.conftest import (
    DEMO_KEY,
    METRICS_AUTH,
    MODEL,
    OTHER_KEY,
    client,
    gateway_config,
    parsed,
    tenant,
)
from tests.gateway.stub_backend import PHRASE

MSGS = [{"role": "user", "content": "Tell me about foxes, please, in detail."}]


def session_for(node_id: str, ids: list[str]) -> str:
    nodes = [Node(i, "http://x", MODEL) for i in ids]
    return next(s for s in (f"s{i}" for i in range(1000)) if affinity_node(s, nodes).node_id == node_id)


def test_second_turn_lands_on_the_node_holding_the_prefix(harness):
    a, b = harness.stub("node-a"), harness.stub("node-b")
    gw = harness.gateway([a, b])
    c = client(gw)
    turn1 = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10)
    first = a if a.requests else b
    other = b if first is a else a
    convo = [*MSGS, {"role": "assistant", "content": turn1.choices[0].message.content},
             {"role": "user", "content": "And about dogs?"}]
    for _ in range(3):
        r = c.chat.completions.create(model=MODEL, messages=convo, max_tokens=5)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert len(first.requests) == 4 and other.requests == []
    m = requests.get(gw.url + "/metrics", headers=METRICS_AUTH, timeout=5).text
    assert 'edgeinfer_gateway_routing_decisions_total{decision="prefix",model="stub-model"} 3.0' in m
    assert 'edgeinfer_gateway_cached_tokens_total{model="stub-model",tenant="demo"}' in m


def test_other_tenant_does_not_follow_the_prefix(harness):
    a, b = harness.stub("node-a"), harness.stub("node-b")
    tenants = [tenant(), tenant(id="t2", api_key_sha256=[config_mod.hash_key(OTHER_KEY)])]
    gw = harness.gateway([a, b], tenants=tenants)
    client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    r = client(gw, key=OTHER_KEY).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # namespaces differ in the stub too
    m = requests.get(gw.url + "/metrics", timeout=5).text
    assert 'decision="prefix"' not in m


def test_session_affinity_is_sticky(harness):
    a, b = harness.stub("node-a"), harness.stub("node-b")
    gw = harness.gateway([a, b])
    s = session_for("node-b", ["node-a", "node-b"])
    c = client(gw, default_headers={"x-session-affinity": s})
    for i in range(4):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=1)
    assert len(b.requests) == 4 and a.requests == []


def test_load_spreads_concurrent_requests(harness):
    a, b = harness.stub("node-a"), harness.stub("node-b")
    a.behaviour.token_delay_s = b.behaviour.token_delay_s = 0.01
    gw = harness.gateway([a, b])
    c = client(gw)
    streams = [c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"x{i}"}],
                                         max_tokens=20, stream=True) for i in range(4)]
    for s in streams:
        next(iter(s))
    assert len(a.requests) == 2 and len(b.requests) == 2
    for s in streams:
        list(s)


@pytest.mark.parametrize("failure", ["status", "drop", "draining"])
def test_retry_on_another_node_before_first_byte(harness, failure):
    bad, good = harness.stub("node-a"), harness.stub("node-b")
    if failure == "status":
        bad.behaviour.fail_status = 500
    elif failure == "drop":
        bad.behaviour.drop_before_first = True
    else:
        bad.behaviour.error_chunk = (503, "node is draining")
    gw = harness.gateway([bad, good])
    s = session_for("node-a", ["node-a", "node-b"])
    c = client(gw, default_headers={"x-session-affinity": s})
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, stream=True) if ch.choices)
    assert text == PHRASE[:5]
    assert len(bad.requests) == 1 and len(good.requests) == 1
    m = requests.get(gw.url + "/metrics", timeout=5).text
    assert 'edgeinfer_gateway_upstream_retries_total{model="stub-model",node="node-a"} 1.0' in m


def test_all_nodes_failing_is_503(harness):
    a, b = harness.stub("node-a"), harness.stub("node-b")
    a.behaviour.fail_status = b.behaviour.fail_status = 500
    gw = harness.gateway([a, b])
    with pytest.raises(openai.InternalServerError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=MSGS)
    assert e.value.status_code == 503 and "tried 2 node(s)" in e.value.message


def test_failure_after_first_byte_ends_stream_with_error_event(harness):
    stub, other = harness.stub("node-a"), harness.stub("node-b")
    stub.behaviour.fail_after_tokens = 3
    gw = harness.gateway([stub, other])
    c = client(gw, default_headers={"x-session-affinity": session_for("node-a", ["node-a", "node-b"])})
    got = []
    with pytest.raises(openai.APIError) as e:
        for ch in c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, stream=True):
            got.append(ch.choices[0].delta.content)
    assert "backend stream failed" in str(e.value.message)
    assert "".join(got) == PHRASE[:3]
    assert len(stub.requests) == 1 and other.requests == []  # no retry once bytes were sent


def test_client_disconnect_aborts_backend_request(harness):
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.02
    gw = harness.gateway([stub])
    stream = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=500, stream=True)
    it = iter(stream)
    next(it), next(it)
    stream.close()
    rid = stub.requests[0].request_id
    assert wait_until(lambda: rid in stub.aborts and rid in stub.disconnects, 5)
    assert rid not in stub.completed
    m = requests.get(gw.url + "/metrics", headers=METRICS_AUTH, timeout=5).text
    assert wait_until(lambda: 'edgeinfer_gateway_client_aborts_total{model="stub-model",tenant="demo"} 1.0'
                      in requests.get(gw.url + "/metrics", headers=METRICS_AUTH, timeout=5).text, 5), m


def test_client_disconnect_non_streaming_aborts(harness):
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.02
    gw = harness.gateway([stub])
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 500}).encode()
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + DEMO_KEY.encode() + b"\r\ncontent-length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert wait_until(lambda: stub.requests, 5)
    sock.close()
    rid = stub.requests[0].request_id
    assert wait_until(lambda: rid in stub.aborts, 5)


def test_graceful_shutdown_lets_running_streams_finish(harness):
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.01
    gw = harness.gateway([stub])
    stream = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, stream=True)
    it = iter(stream)
    parts = [next(it).choices[0].delta.content]
    stopper = threading.Thread(target=gw.stop)
    stopper.start()
    time.sleep(0.1)
    with pytest.raises(requests.ConnectionError):  # no new connections while draining
        requests.get(gw.url + "/health", timeout=1)
    parts += [ch.choices[0].delta.content or "" for ch in it if ch.choices]
    stopper.join(10)
    assert "".join(parts) == (PHRASE * 2)[:40]


def test_key_rotation_by_admin_reload(harness, tmp_path):
    stub = harness.stub()
    admin = "admin-secret"
    path = tmp_path / "gw.toml"

    def write(keys: list[str]) -> None:
        data = gateway_config(harness.tokenizer_dir, [stub], [tenant(api_key_sha256=[config_mod.hash_key(k)
                                                                                     for k in keys])],
                              admin_key_sha256=config_mod.hash_key(admin))
        lines = ["[server]"] + [f"{k} = {json.dumps(v)}" for k, v in data["server"].items()]
        for section in ("models", "nodes", "tenants"):
            for item in data[section]:
                lines += [f"[[{section}]]"] + [f"{k} = {json.dumps(v)}" for k, v in item.items()]
        path.write_text("\n".join(lines) + "\n")

    write([DEMO_KEY])
    gw = harness.gateway([stub], cfg=config_mod.load(path))
    reload = lambda key=admin: requests.post(gw.url + "/admin/reload",  # noqa: E731
                                             headers={"authorization": f"Bearer {key}"}, timeout=5)
    with pytest.raises(openai.AuthenticationError):
        client(gw, key=OTHER_KEY).models.list()
    write([DEMO_KEY, OTHER_KEY])  # step 1: add the new key
    assert reload().json() == {"reloaded": True, "tenants": 1}
    assert client(gw, key=OTHER_KEY).models.list().data and client(gw).models.list().data
    write([OTHER_KEY])  # step 2: retire the old key
    reload()
    with pytest.raises(openai.AuthenticationError):
        client(gw).models.list()
    assert reload("wrong").status_code == 401
    path.write_text("[[tenants]]\nid = 1\n")
    bad = reload()
    assert bad.status_code == 400 and "keeping the current tenants" in bad.json()["error"]["message"]
    assert client(gw, key=OTHER_KEY).models.list().data


def test_metrics_and_json_access_log_without_keys(harness, caplog):
    gw = harness.gateway([harness.stub()])
    with caplog.at_level(logging.INFO, logger="edgeinfer.gateway.access"):
        client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            client(gw, key="sk-secret-wrong").models.list()
    recs = [json.loads(r.getMessage()) for r in caplog.records if r.name == "edgeinfer.gateway.access"]
    ok = next(r for r in recs if r["path"] == "/v1/chat/completions")
    assert ok["status"] == 200 and ok["tenant"] == "demo" and ok["completion_tokens"] == 3 and ok["node"] == "node-a"
    assert len(ok["request_id"]) == 32 and ok["route"] in ("load", "prefix", "affinity")
    assert any(r["status"] == 401 for r in recs)
    assert "sk-" not in caplog.text
    m = requests.get(gw.url + "/metrics", headers=METRICS_AUTH, timeout=5).text
    for needle in ('edgeinfer_gateway_requests_total{endpoint="chat",model="stub-model",status="200",tenant="demo"} 1.0',
                   'edgeinfer_gateway_completion_tokens_total{model="stub-model",tenant="demo"} 3.0',
                   "edgeinfer_gateway_time_to_first_token_seconds_bucket",
                   "edgeinfer_gateway_inter_token_latency_seconds_count"):
        assert needle in m


def test_tenants_config_errors_are_clear(tokenizer_dir):
    with pytest.raises(config_mod.ConfigError, match="64 hex"):
        parsed(gateway_config(tokenizer_dir, [], [tenant(api_key_sha256=["abc"])]))
    with pytest.raises(config_mod.ConfigError, match="unknown field"):
        parsed({"server": {"prot": 1}})
    with pytest.raises(config_mod.ConfigError, match="share an API key"):
        parsed(gateway_config(tokenizer_dir, [], [tenant(), tenant(id="t2")]))


# ---- prefill/decode disaggregation: what the two hops are ranked by (gateway/routing.py)
def _info_node(node_id: str, role: str = "both", **kw) -> Node:
    from edgeinfer.protocol.wire import BackendInfo

    n = Node(node_id, "http://x", MODEL, **kw)
    n.info = BackendInfo(node_id, MODEL, "fp-1", "fp8_e4m3", 16, 4096, "1", "active", role=role)
    return n


async def test_the_prefill_node_is_chosen_by_tokens_not_requests():
    from edgeinfer.cache_store.index import InMemoryPageIndex
    from edgeinfer.gateway.routing import Router

    index = InMemoryPageIndex()
    router = Router(index, b"seed")
    busy = _info_node("busy", "prefill", inflight=5)          # five short prompts in flight: 300 tokens
    long = _info_node("long", "prefill", inflight=1)          # one long prompt: 3,000 tokens
    busy.prefill_pending, long.prefill_pending = 300, 3000
    tokens = list(range(1000))
    ranked = await router.rank_prefill(MODEL, "ns", tokens, [long, busy])
    assert [c.node.node_id for c in ranked] == ["busy", "long"] and ranked[0].decision == "prefill"
    long.prefill_pending, busy.prefill_queued = 0, 500          # its reported queue counts too
    assert (await router.rank_prefill(MODEL, "ns", tokens, [long, busy]))[0].node is long
    # the pages it holds are tokens it would not compute: 40 cached pages (640 tokens) outweigh 500 queued
    await index.publish(MODEL, "busy", router.hashes_for("ns", busy, tokens)[:40])
    long.prefill_pending = 200
    assert (await router.rank_prefill(MODEL, "ns", tokens, [long, busy]))[0].node is busy


async def test_the_decode_node_weighs_kv_occupancy():
    from edgeinfer.cache_store.index import InMemoryPageIndex
    from edgeinfer.gateway.routing import Router

    router = Router(InMemoryPageIndex(), b"seed", load_cost_tokens=32, kv_cost_tokens=256)
    full, empty = _info_node("full", "decode"), _info_node("empty", "decode", inflight=2)
    full.kv_usage, empty.kv_usage = 0.95, 0.05              # 243 tokens vs 13 + 64 of load
    assert (await router.rank(MODEL, "ns", list(range(100)), [full, empty]))[0].node is empty


def test_ready_answers_feed_kv_occupancy_and_queued_prefill_tokens():
    from edgeinfer.gateway.nodes import _read_load

    n = _info_node("n")
    _read_load(n, b'{"kv_pages_used": 30, "kv_pages_total": 120, "prefill_tokens_queued": 777}')
    assert n.kv_usage == 0.25 and n.prefill_queued == 777
    _read_load(n, b'{"status": "ready"}')                   # an older backend: the last values stay
    _read_load(n, b"not json")
    assert n.kv_usage == 0.25 and n.prefill_queued == 777 and n.role == "both"


@pytest.mark.parametrize("field,value", [("disagg_prefill_timeout_s", 0), ("disagg_prefill_timeout_s", float("inf")),
                                         ("disagg_min_prefill_tokens", -1), ("route_kv_cost_tokens", -5)])
def test_disaggregation_settings_are_checked(tokenizer_dir, field, value):
    with pytest.raises(config_mod.ConfigError, match=field):
        parsed(gateway_config(tokenizer_dir, [], **{field: value}))
