"""The backend's internal API answers only the gateway and other nodes (the internal secret); the operator key
opens only /admin/*.

Real engine (SmolLM2) behind the real aiohttp app over loopback HTTP. The engine's generate/abort are
wrapped by a recorder that delegates to them, so a test can tell that a refused request never reached it.
"""

from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.server import BackendState
from edgeinfer.protocol.wire import StreamChunk
from tests.support.inproc import serve

SECRET = "gateway-internal-secret-0123456789"
OPERATOR_KEY = "operator-key-for-auth-tests"
GATEWAY = {"authorization": f"Bearer {SECRET}"}
OPERATOR = {"authorization": f"Bearer {OPERATOR_KEY}"}
WRONG = [
    {},
    {"authorization": ""},
    {"authorization": SECRET},                               # no scheme
    {"authorization": f"Basic {SECRET}"},
    {"authorization": f"Bearer {SECRET[:-1]}"},              # a prefix of the secret
    {"authorization": f"Bearer {SECRET}x"},                  # the secret plus more
    {"authorization": f"Bearer {SECRET[:-1]}X"},             # same length, last character differs
    {"authorization": f"bearer {SECRET.upper()}"},
    {"authorization": "Bearer sk-edgeinfer-demo"},           # a tenant key is not the secret
    {"x-internal-secret": SECRET},                           # the right value in another header
]


class Recorder:
    """Delegates to the engine's stream_batches (what the server's generate calls)/abort and remembers every call."""

    def __init__(self, engine: LLMEngine) -> None:
        self.calls: list[str] = []
        gen, abort = engine.stream_batches, engine.abort

        def stream(req, keepalive_s=None):
            self.calls.append(f"generate:{req.request_id}")
            return gen(req, keepalive_s)

        def record_abort(request_id):
            self.calls.append(f"abort:{request_id}")
            return abort(request_id)

        engine.stream_batches = stream      # type: ignore[method-assign]
        engine.abort = record_abort         # type: ignore[method-assign]


@pytest.fixture
async def backend(smol_model, smol_tokenizer):
    engine = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=128))
    metrics = BackendMetrics("smol")
    st = BackendState(engine=engine, metrics=metrics, node_id="n-auth", operator_key=OPERATOR_KEY,
                      internal_secret=SECRET)
    rec = Recorder(engine)
    async with serve(st) as http:
        yield st, http, rec


def body(rid: str, max_tokens: int = 4, **sp) -> dict:
    return {"request_id": rid, "prompt_token_ids": list(range(100, 140)),
            "sampling": {"temperature": 0, "max_tokens": max_tokens, **sp}, "cache_namespace": "tenant-a"}


async def _stream(resp) -> list[StreamChunk]:
    return [msgspec.json.decode(line, type=StreamChunk) async for line in resp.content if line.strip()]


@pytest.mark.parametrize("headers", WRONG)
async def test_internal_api_refuses_a_missing_or_wrong_secret(backend, headers):
    st, http, rec = backend
    for method, path, payload in (("POST", "/internal/generate", body("r-bad")),
                                  ("POST", "/internal/abort", {"request_id": "r-bad"}),
                                  ("GET", "/internal/info", None)):
        async with http.request(method, path, json=payload, headers=headers) as r:
            assert r.status == 401, (path, await r.text())
            err = (await r.json())["error"]
            assert "internal secret" in err["message"] and err["code"] == 401
    assert rec.calls == [] and st.engine.blocks.queries == 0 and not st.in_flight


async def test_the_gateway_secret_generates_aborts_and_reads_info(backend):
    st, http, rec = backend
    async with http.post("/internal/generate", json=body("r-ok"), headers=GATEWAY) as r:
        assert r.status == 200
        chunks = await _stream(r)
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 4
    async with http.get("/internal/info", headers=GATEWAY) as r:
        assert r.status == 200 and (await r.json())["node_id"] == "n-auth"
    async with http.post("/internal/abort", json={"request_id": "r-ok"}, headers=GATEWAY) as r:
        assert r.status == 200 and (await r.json()) == {"aborted": False}
    assert rec.calls == ["generate:r-ok", "abort:r-ok"]


async def test_a_wrong_secret_cannot_abort_another_request(backend):
    """Before: anyone who could connect could abort any request by id (e.g. another tenant's)."""
    st, http, rec = backend
    r = await http.post("/internal/generate", json=body("victim", max_tokens=60, ignore_eos=True), headers=GATEWAY)
    assert r.status == 200
    first = await r.content.readline()                    # the victim is running
    assert first.strip()
    for headers in WRONG:
        async with http.post("/internal/abort", json={"request_id": "victim"}, headers=headers) as a:
            assert a.status == 401
    rest = await _stream(r)
    r.close()
    assert rest[-1].finish_reason == "length"             # it ran to the end
    assert rec.calls == ["generate:victim"]
    # the gateway itself can abort
    r = await http.post("/internal/generate", json=body("stoppable", max_tokens=200, ignore_eos=True),
                        headers=GATEWAY)
    await r.content.readline()
    async with http.post("/internal/abort", json={"request_id": "stoppable"}, headers=GATEWAY) as a:
        assert (await a.json()) == {"aborted": True}
    chunks = await _stream(r)
    r.close()
    assert chunks[-1].finish_reason == "abort"


async def test_the_operator_key_opens_only_the_operators_endpoints(backend):
    """Issue 53: the operator key (drain, undrain, info, canary) never opens /internal/*, so whoever holds it cannot
    make a node pull pages from a URL of theirs (and send it the internal secret). The canary has its own endpoint,
    whose request cannot name a kv_source, a tenant or a grammar."""
    st, http, rec = backend
    for path, payload in (("/internal/generate", body("op-gen") | {"kv_source": {"node_id": "p", "url": "http://x"}}),
                          ("/internal/kv/pages", {"hashes": []}), ("/internal/abort", {"request_id": "x"})):
        async with http.post(path, json=payload, headers=OPERATOR) as r:
            assert r.status == 401, path
    async with http.get("/internal/info", headers=OPERATOR) as r:
        assert r.status == 401
    async with http.post("/admin/canary", json={"prompt_token_ids": list(range(100, 110)), "max_tokens": 3},
                         headers=OPERATOR) as r:
        assert r.status == 200 and (await _stream(r))[-1].finish_reason == "length"
    async with http.post("/admin/canary", json={"prompt_token_ids": [1, 2], "kv_source": {"node_id": "p", "url": "x"}},
                         headers=OPERATOR) as r:
        assert r.status == 400 and "kv_source" in (await r.json())["error"]["message"]
    for payload in ({"prompt_token_ids": [], "max_tokens": 3}, {"prompt_token_ids": [1], "max_tokens": 10_000}):
        async with http.post("/admin/canary", json=payload, headers=OPERATOR) as r:
            assert r.status == 400
    async with http.post("/admin/canary", json={"prompt_token_ids": [1, 2]}, headers=GATEWAY) as r:
        assert r.status == 401          # the gateway's secret is not the operator's key either
    async with http.get("/admin/info", headers=OPERATOR) as r:
        assert r.status == 200 and (await r.json())["node_id"] == "n-auth"
    st.state = "draining"               # the canary reaches a drained node (a rollout's gate before undrain)
    async with http.post("/admin/canary", json={"prompt_token_ids": [5, 6, 7], "max_tokens": 2},
                         headers=OPERATOR) as r:
        assert r.status == 200 and (await _stream(r))[-1].finish_reason == "length"
    assert len(rec.calls) == 2 and all(c.startswith("generate:ops-canary-") for c in rec.calls)


async def test_health_ready_metrics_stay_open_and_admin_keeps_its_own_key(backend):
    st, http, _ = backend
    for path in ("/health", "/ready", "/metrics"):
        async with http.get(path) as r:
            assert r.status == 200, path
    async with http.post("/admin/drain", headers=GATEWAY) as r:   # the gateway's secret is not an admin key
        assert r.status == 401
    assert st.state == "active"


async def test_a_non_ascii_or_huge_authorization_header_is_a_401_not_a_crash(backend):
    _, http, rec = backend
    for value in ("Bearer sécret-ünïcode-😀", "Bearer " + "x" * 6000, f"Bearer {SECRET}é"):
        async with http.post("/internal/generate", json=body("odd"),
                             headers={"authorization": value.encode("utf-8").decode("latin-1")}) as r:
            assert r.status == 401
    assert rec.calls == []


def _raw_status(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        head = b""
        while b"\r\n" not in head:
            head += s.recv(4096)
    return int(head.split()[1])


async def test_a_non_utf8_authorization_header_is_a_401_not_a_crash(backend):
    _, http, rec = backend
    port = http._base_url.port
    for auth in (b"Bearer \xff\xfe", b"Bearer " + SECRET.encode() + b"\xc3"):
        status = await asyncio.to_thread(
            _raw_status, port, b"POST /internal/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
            b"Authorization: " + auth + b"\r\nConnection: close\r\n\r\n")
        assert status == 401
    assert rec.calls == []


def test_no_secret_configured_means_open_only_by_explicit_choice(monkeypatch, capsys, tmp_path):
    from edgeinfer.backend.server import parse_args

    monkeypatch.delenv("EDGEINFER_INTERNAL_SECRET", raising=False)
    with pytest.raises(SystemExit) as e:
        parse_args([])
    assert e.value.code == 2 and "no internal secret" in capsys.readouterr().err
    monkeypatch.setenv("EDGEINFER_INTERNAL_SECRET", "short")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "5 characters; at least 16 needed" in capsys.readouterr().err
    monkeypatch.setenv("EDGEINFER_INTERNAL_SECRET", SECRET)
    assert parse_args([]).internal_secret == SECRET
    f = tmp_path / "secret"
    f.write_text("from-a-file-0123456789\n")
    assert parse_args(["--internal-secret-file", str(f)]).internal_secret == "from-a-file-0123456789"
    with pytest.raises(SystemExit):
        parse_args(["--internal-secret-file", str(tmp_path / "missing")])
    assert "--internal-secret-file" in capsys.readouterr().err
    assert parse_args(["--insecure-no-internal-auth"]).internal_secret is None


async def test_concurrent_requests_with_and_without_the_secret(backend):
    """Refusals do not disturb the gateway's own requests running at the same time."""
    _, http, rec = backend

    async def one(i: int) -> int:
        headers = GATEWAY if i % 2 else WRONG[i % len(WRONG)]
        async with http.post("/internal/generate", json=body(f"c{i}"), headers=headers) as r:
            if r.status == 200:
                assert (await _stream(r))[-1].finish_reason == "length"
            return r.status

    statuses = await asyncio.gather(*(one(i) for i in range(8)))
    assert statuses == [401, 200] * 4
    assert sorted(rec.calls) == sorted(f"generate:c{i}" for i in range(1, 8, 2))


async def test_metrics_show_tenant_ids_only_to_the_gateway_or_the_operator(backend):
    """Issue 39 item 6: the open /metrics carries no tenant ids; the gateway's secret and the operator key see
    the per-tenant series."""
    _, http, _ = backend
    req = {**body("r-tenant"), "tenant": {"id": "tenant-secret-co"}}
    async with http.post("/internal/generate", json=req, headers=GATEWAY) as r:
        assert r.status == 200 and (await _stream(r))[-1].finish_reason == "length"
    async with http.get("/metrics") as r:
        text = await r.text()
    assert r.status == 200 and "edgeinfer_backend_requests_running" in text
    assert "tenant-secret-co" not in text and "tenant=" not in text
    for headers in (GATEWAY, OPERATOR):
        async with http.get("/metrics", headers=headers) as r:
            assert 'tenant="tenant-secret-co"' in await r.text()


class _SlowExtension:
    """An extension whose before_generate finishes its work even when the caller leaves (shielded), as a
    store write must: the handler reaches the response headers after the client is gone."""

    handoff = None

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def on_drain(self, app) -> None:
        pass

    async def on_undrain(self, app) -> None:
        pass

    async def before_generate(self, app, req) -> None:
        try:
            await asyncio.shield(asyncio.sleep(0.5))
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)
            asyncio.current_task().uncancel()   # type: ignore[union-attr]
        self.done.set()

    async def start(self, app) -> None:
        pass

    async def stop(self, app) -> None:
        pass


async def test_a_caller_leaving_before_the_headers_is_one_info_line_not_an_error(backend, caplog):
    import logging

    st, http, _ = backend
    ext = _SlowExtension()
    st.extensions.append(ext)
    port = http._base_url.port   # type: ignore[union-attr]
    payload = msgspec.json.encode(body("r-gone"))
    raw = (f"POST /internal/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    with caplog.at_level(logging.INFO):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.transport.abort()            # the caller leaves before any response byte
        await asyncio.wait_for(ext.done.wait(), 10)
        await asyncio.sleep(0.5)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    left = [r for r in caplog.records if "left before the response headers" in r.getMessage()]
    assert len(left) == 1 and left[0].levelno == logging.INFO
    assert not st.in_flight
