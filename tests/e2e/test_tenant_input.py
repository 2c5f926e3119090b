"""One tenant's input must not fail another's (issue 14, items 2, 6, 7, 8), through real gateways on
loopback: a prompt over the tenant's character cap is refused before it is tokenized; huge prompts are
tokenized off the event loop (/health stays fast); clients resetting during admission leak no Redis
lease; non-UTF-8 headers and a bad content-encoding are 4xx, not 500; a client disconnect is one INFO line.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import struct
import threading
import time

import pytest
import requests

from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.state import STATE
from tests.gateway.conftest import DEMO_KEY, MODEL, client, tenant

AUTH = {"authorization": f"Bearer {DEMO_KEY}", "content-type": "application/json"}


def _spy_tokenizer(gw) -> list[int]:
    """Records the size of every text the gateway's model tokenizes in-process (the real tokenizer runs)."""
    model = gw.app[STATE].models[MODEL].ids      # the PromptEncoder the gateway process tokenizes with
    calls: list[int] = []
    real = model._encode_text

    def encode(text: str) -> list[int]:
        calls.append(len(text))
        return real(text)

    model._encode_text = encode
    return calls


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"], err
    return err


# ---- item 2: a per-tenant character cap, checked before anything expensive ------------------------

def test_prompt_over_the_tenants_char_cap_is_413_naming_the_cap_before_tokenizing(harness):
    stub = harness.stub()
    gw = harness.gateway([stub], tenants=[tenant(max_prompt_chars=1000)])
    calls = _spy_tokenizer(gw)
    body = {"model": MODEL, "messages": [{"role": "system", "content": "s" * 600},
                                         {"role": "user", "content": "u" * 401}]}
    err = _error(requests.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30),
                 413, "prompt_too_large")
    assert "1001 characters" in err["message"] and "at most 1000" in err["message"], err
    assert "max_prompt_chars" in err["message"] and err["param"] == "messages"
    err = _error(requests.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": ["p" * 500] * 3},
                               headers=AUTH, timeout=30), 413, "prompt_too_large")
    assert "1500 characters" in err["message"] and err["param"] == "prompt"
    assert calls == [] and stub.requests == [], "a refused prompt was tokenized or reached the backend"
    ok = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "u" * 1000}],
                                            max_tokens=2)
    assert ok.choices[0].message.content and calls, "a prompt at the cap is served"


def test_the_default_char_cap_is_finite_and_validated():
    base = {"id": "t", "api_key_sha256": [config_mod.hash_key("k")]}
    cfg = config_mod.parse({"tenants": [base]})
    assert cfg.tenants[0].max_prompt_chars == 1_000_000
    with pytest.raises(config_mod.ConfigError, match="max_prompt_chars=-1 must be >= 0"):
        config_mod.parse({"tenants": [{**base, "max_prompt_chars": -1}]})
    with pytest.raises(config_mod.ConfigError, match="max_prompt_char"):
        config_mod.parse({"tenants": [{**base, "max_prompt_char": 10}]})
    with pytest.raises(config_mod.ConfigError, match="tokenizer_workers=-1"):
        config_mod.parse({"server": {"tokenizer_workers": -1}})


def test_rate_and_concurrency_refusals_tokenize_nothing(harness):
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.05
    gw = harness.gateway([stub], tenants=[tenant(max_concurrent_streams=1, requests_per_min=3)])
    calls = _spy_tokenizer(gw)
    c = client(gw)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                       stream=True)
    next(iter(stream))
    assert len(calls) == 1
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1500}]}
    r = requests.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    _error(r, 429, "concurrency_limit_exceeded")
    stream.close()
    for _ in range(100):
        r = requests.post(gw.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, headers=AUTH, timeout=30)
        if r.status_code != 429 or r.json()["error"]["code"] != "concurrency_limit_exceeded":
            break
        time.sleep(0.02)                     # the stream's lease goes back when its handler ends
    assert r.status_code == 200, r.text[:300]
    requests.post(gw.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, headers=AUTH, timeout=30)
    n = len(calls)
    _error(requests.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30),
           429, "rate_limit_exceeded")
    assert len(calls) == n, "a request refused by the rate limit was tokenized"


# ---- item 2: huge prompts are tokenized off the event loop ---------------------------------------

HUGE = 3_900_000


def _probe_health(url: str, stop: threading.Event, out: list[float]) -> None:
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    while not stop.is_set():
        t = time.perf_counter()
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t)
        assert resp.status == 200
        time.sleep(0.01)
    conn.close()


def test_health_p99_under_50ms_while_four_huge_prompts_arrive(harness):
    """The issue's demonstration: four ~3.9 MB prompts (under a raised cap) at once; /health probed every
    ~10 ms throughout stays fast. Before the fix the tokenizer held the GIL for seconds per prompt."""
    stub = harness.stub()
    gw = harness.gateway([stub], tenants=[tenant(max_prompt_chars=4_000_000)], max_body_bytes=5 * 1024 * 1024)
    words = "The quick brown fox jumps over the lazy dog 12345, and then some more text! "
    results: list[requests.Response] = []
    bodies = [json.dumps({"model": MODEL, "messages": [{"role": "user", "content":
                                                        (f"{i} " + words * (HUGE // len(words) + 1))[:HUGE]}]})
              .encode() for i in range(4)]     # built before the window: this process's GIL is the gateway's

    def send(i: int) -> None:
        results.append(requests.post(gw.url + "/v1/chat/completions", data=bodies[i], headers=AUTH, timeout=600))

    latencies: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=_probe_health, args=(gw.url, stop, latencies))
    prober.start()
    time.sleep(0.2)
    senders = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    t0 = time.perf_counter()
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    window = time.perf_counter() - t0
    stop.set()
    prober.join()
    for r in results:     # tokenized (the whole prompt: far beyond the stub's 2048-token context), refused
        err = _error(r, 400, "context_length_exceeded")
        assert f"prompt has {HUGE + 19} tokens" in err["message"], err   # ChatML adds 19 tokens
    lat = sorted(latencies)
    p99 = lat[int(0.99 * (len(lat) - 1))]
    print(f"four {HUGE}-char prompts: window {window:.2f}s, {len(lat)} /health probes, "
          f"p50 {lat[len(lat) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms")
    assert len(lat) >= 50, f"only {len(lat)} probes in {window:.1f}s"
    assert p99 < 0.050, f"/health p99 {p99 * 1000:.0f} ms while huge prompts were tokenized"
    assert stub.requests == []


# ---- item 6: clients resetting during admission leak no lease ------------------------------------

def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close with RST
    sock.close()


_BUSY = """
local start = os.clock()
while os.clock() - start < tonumber(ARGV[1]) do end
return 1
"""   # TIME is frozen inside a script; os.clock is CPU time, so the wall time is at least ARGV[1]


def _evalsha_calls(r) -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_clients_resetting_during_admission_leave_no_leases(harness, valkey):
    """The issue's race, made deterministic: 40 clients' admission scripts wait in a busy Redis (a Lua
    loop); the gateway's event loop is stalled, the clients reset, then the scripts run (leases added,
    replies queued); when the loop resumes, handlers are cancelled with their admission reply unread. Before the fix those leases stayed until their 30 s TTL and the tenant (cap 2) got 429."""
    import redis

    r = redis.Redis.from_url(valkey.url)
    r.flushall()
    gw = harness.gateway([harness.stub()], tenants=[tenant(max_concurrent_streams=2)], redis_url=valkey.url)
    st = gw.app[STATE]
    st.admission.timeout_s = 30.0     # wait for the busy Redis instead of falling back to in-process limits

    async def connect(n: int) -> None:  # n pooled connections, so no admission waits on a Redis handshake
        await asyncio.gather(*(st.redis.ping() for _ in range(n)))

    gw.call(connect(48))
    deadline = time.monotonic() + 30
    while requests.get(gw.url + "/ready", timeout=10).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)              # the stub has been probed
    c = client(gw)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "warm"}], max_tokens=1)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {DEMO_KEY}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
    evals = _evalsha_calls(r)
    busy = threading.Thread(target=lambda: redis.Redis.from_url(valkey.url).eval(_BUSY, 0, 0.5))
    busy.start()
    time.sleep(0.02)
    socks = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(40)]
    for s in socks:
        s.sendall(raw)
    deadline = time.monotonic() + 10
    while st.inflight < 40 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)                  # every handler is now awaiting its admission script
    release = threading.Event()
    gw.loop.call_soon_threadsafe(release.wait, 30)   # stall the gateway's loop (like a long GC pause)
    time.sleep(0.02)
    for s in socks:                   # the resets reach the gateway first ...
        _reset(s)
    busy.join()                       # ... then Redis runs the 40 scripts: leases added, replies sent
    time.sleep(0.2)
    release.set()
    deadline = time.monotonic() + 15
    while (st.inflight or st.tasks or getattr(st.admission, "orphans", ()) or r.zcard("ei:cc:{demo}")
           ) and time.monotonic() < deadline:
        time.sleep(0.05)     # every burst handler has ended (and what it started): nothing should be held now
    assert st.inflight == 0
    assert _evalsha_calls(r) - evals >= 20, "the reset requests' admission scripts did not run"
    assert r.zcard("ei:cc:{demo}") == 0, f"{r.zcard('ei:cc:{demo}')} leases leaked by reset clients"
    ok = c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=1)
    assert ok.status_code == 200
    deadline = time.monotonic() + 10
    while (st.admission.streams.held or r.zcard("ei:cc:{demo}")) and time.monotonic() < deadline:
        time.sleep(0.02)              # the served request's lease goes back from a task after the answer
    assert st.admission.streams.held == {} and r.zcard("ei:cc:{demo}") == 0


# ---- item 7: non-UTF-8 headers and a bad content-encoding are 4xx --------------------------------

def _raw(port: int, data: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += s.recv(65536)
        head, _, body = buf.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += s.recv(65536)
    return int(head.split()[1]), body


@pytest.mark.parametrize("path, method, body", [
    ("/v1/models", "GET", b""),
    ("/v1/chat/completions", "POST", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
     .encode()),
])
def test_non_utf8_authorization_is_401_with_an_openai_body(harness, path, method, body):
    stub = harness.stub()
    gw = harness.gateway([stub])
    for auth in (b"Bearer \xff\xfe-key", b"Bearer sk-edgeinfer-demo\xc3", b"\xff"):
        status, out = _raw(gw.port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                                    .encode() + b"Authorization: " + auth + b"\r\n\r\n" + body)
        assert status == 401, (auth, status, out[:300])
        err = json.loads(out)["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key", err
    assert stub.requests == []


def test_non_utf8_session_affinity_is_400(harness):
    gw = harness.gateway([harness.stub()])
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).encode()
    status, out = _raw(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                       + DEMO_KEY.encode() + f"\r\nContent-Length: {len(body)}\r\n".encode()
                       + b"X-Session-Affinity: s\xff\r\n\r\n" + body)
    assert status == 400, out[:300]
    assert json.loads(out)["error"]["param"] == "x-session-affinity"


def test_non_utf8_admin_key_is_401_at_gateway_admin(harness):
    gw = harness.gateway([harness.stub()], admin_key_sha256=config_mod.hash_key("admin-key"))
    status, out = _raw(gw.port, b"GET /admin/nodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\r\n\r\n")
    assert status == 401, out[:300]
    assert json.loads(out)["error"]["code"] == "invalid_api_key"


def test_gzip_content_encoding_with_a_body_that_is_not_gzip_is_400(harness, caplog):
    caplog.set_level(logging.INFO)
    stub = harness.stub()
    gw = harness.gateway([stub])
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    headers = {**AUTH, "content-encoding": "gzip"}
    r = requests.post(gw.url + "/v1/chat/completions", data=body, headers=headers, timeout=30)
    err = _error(r, 400, "invalid_content_encoding")
    assert err["type"] == "invalid_request_error" and "gzip" in err["message"]
    assert stub.requests == []
    ok = requests.post(gw.url + "/v1/chat/completions", data=gzip.compress(body), headers=headers, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"], ok.text[:300]
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [(r.name, r.getMessage()[:200]) for r in bad]


# ---- item 8: a client disconnect is one INFO line ------------------------------------------------

def _from_stub(record: logging.LogRecord) -> bool:
    """The stub backend (in this process) logs its own writes to the aborted gateway connection."""
    return bool(record.exc_info) and "stub_backend.py" in logging.Formatter().formatException(record.exc_info)


@pytest.mark.parametrize("delay_s", [0.0, 0.005])
def test_client_disconnect_mid_stream_logs_one_info_line(harness, caplog, delay_s):
    stub = harness.stub()
    stub.behaviour.token_delay_s = delay_s
    stub.behaviour.phrase = "x" * 4000
    gw = harness.gateway([stub])
    caplog.set_level(logging.DEBUG)
    rids = [f"disconnect-{i}" for i in range(4)]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
                       "stream": True})
    for rid in rids:
        s = socket.create_connection(("127.0.0.1", gw.port))
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {DEMO_KEY}\r\n"
                   f"X-Request-Id: {rid}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                   f"{body}").encode())
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
        _reset(s)
    deadline = time.monotonic() + 10
    while len(stub.aborts) + len(stub.disconnects) < len(rids) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    bad = [r for r in caplog.records if (r.levelno >= logging.WARNING or r.exc_info) and not _from_stub(r)]
    assert not bad, [(r.name, r.levelname, r.getMessage()[:200]) for r in bad]
    for rid in rids:
        lines = [r for r in caplog.records if r.name == "edgeinfer.gateway" and rid in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in lines]
        assert "client closed the connection" in lines[0].getMessage()


async def test_non_utf8_operator_key_at_backend_admin_drain_is_401(smol_model, smol_tokenizer):
    from aiohttp import web

    from edgeinfer.backend.engine.engine import LLMEngine
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.metrics import BackendMetrics
    from edgeinfer.backend.server import BackendState, make_app

    st = BackendState(engine=LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=16)),
                      metrics=BackendMetrics("smol"), node_id="n-utf8", operator_key="op-secret")
    runner = web.AppRunner(make_app(st), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        for auth in (b"Bearer \xff\xfe", b"Bearer op-secret\xc3"):
            status, out = await asyncio.to_thread(
                _raw, port, b"POST /admin/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nAuthorization: "
                + auth + b"\r\n\r\n")
            assert status == 401, (auth, status, out[:200])
        assert st.state == "active"
    finally:
        await runner.cleanup()
