"""The backend's internal API over real loopback HTTP: NDJSON stream, errors, disconnect -> abort, drain."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.server import BackendState
from edgeinfer.protocol.wire import StreamChunk
from tests.support.inproc import serve

OPERATOR_KEY = "op-secret"


@pytest.fixture
async def backend(smol_model, smol_tokenizer):
    engine = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=128))
    metrics = BackendMetrics("smol")
    engine.observers.append(metrics)
    st = BackendState(engine=engine, metrics=metrics, node_id="n-test", operator_key=OPERATOR_KEY)
    async with serve(st) as http:
        yield st, http


def body(rid: str, ids: list[int], **sp) -> dict:
    return {"request_id": rid, "prompt_token_ids": ids, "sampling": {"temperature": 0, **sp},
            "cache_namespace": "tenant-a"}


async def test_generate_streams_ndjson_until_finish(backend, smol_tokenizer):
    st, http = backend
    ids = smol_tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    async with http.post("/internal/generate", json=body("r1", ids, max_tokens=30)) as r:
        assert r.status == 200 and r.headers["content-type"] == "application/x-ndjson"
        chunks = [msgspec.json.decode(line, type=StreamChunk) async for line in r.content]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.prompt_tokens == len(ids)
    assert "Paris" in "".join(c.text for c in chunks)
    assert all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("payload,status,needle", [
    (b"{not json", 400, "malformed JSON"),
    (b'{"request_id": "x"}', 422, "prompt_token_ids"),
    (msgspec.json.encode(body("x", [1], temperature=float("nan"))), 422, "temperature"),
    (msgspec.json.encode(body("x", [1], bogus=1)), 422, "bogus"),
    (msgspec.json.encode(body("x", [1], top_p=0)), 400, "top_p=0"),
    (msgspec.json.encode(body("x", [1] * 2100)), 400, "KV pages"),
])
async def test_bad_requests_get_clear_errors(backend, payload, status, needle):
    _, http = backend
    async with http.post("/internal/generate", data=payload) as r:
        assert r.status == status
        err = (await r.json())["error"]
        assert needle in err["message"]


async def test_client_disconnect_aborts_and_frees_pages(backend):
    st, http = backend
    before = st.engine.blocks.num_used
    r = await http.post("/internal/generate", json=body("r-dc", list(range(100, 400)), max_tokens=200,
                                                        ignore_eos=True))
    await r.content.readline()        # first token arrived
    r.close()                         # client goes away mid-stream
    for _ in range(100):
        await asyncio.sleep(0.05)
        if not st.engine.scheduler.running and st.engine.blocks.num_used == before:
            break
    assert st.engine.blocks.num_used == before
    assert "r-dc" not in st.in_flight


async def test_drain_needs_operator_key_and_stops_new_requests(backend):
    st, http = backend
    async with http.post("/admin/drain") as r:
        assert r.status == 401
    async with http.post("/admin/drain", headers={"authorization": "Bearer tenant-key"}) as r:
        assert r.status == 401
    async with http.post("/admin/drain", headers={"authorization": f"Bearer {OPERATOR_KEY}"}) as r:
        assert r.status == 200 and (await r.json())["state"] == "draining"
    async with http.get("/ready") as r:
        assert r.status == 503
    async with http.post("/internal/generate", json=body("r-drained", [1, 2, 3])) as r:
        assert r.status == 503
    async with http.post("/admin/undrain", headers={"authorization": f"Bearer {OPERATOR_KEY}"}) as r:
        assert r.status == 200
    async with http.get("/ready") as r:
        assert r.status == 200
    async with http.get("/metrics") as r:
        text = await r.text()
    assert "edgeinfer_backend_kv_pages_total" in text and OPERATOR_KEY not in text


async def test_start_drained_node_takes_only_the_operator_canary(smol_model, smol_tokenizer):
    engine = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=64))
    st = BackendState(engine=engine, metrics=BackendMetrics("smol"), node_id="n-new", operator_key=OPERATOR_KEY,
                      state="draining")
    op = {"authorization": f"Bearer {OPERATOR_KEY}"}
    async with serve(st) as http:
        async with http.get("/ready") as r:
            assert r.status == 503                       # routers skip it
        async with http.post("/internal/generate", json=body("routed", [1, 2, 3], max_tokens=2)) as r:
            assert r.status == 503
        async with http.post("/internal/generate", json=body("routed", [1, 2, 3], max_tokens=2),
                             headers={"authorization": "Bearer tenant-key"}) as r:
            assert r.status == 503
        async with http.post("/internal/generate", json=body("canary", [1, 2, 3], max_tokens=2,
                                                               ignore_eos=True), headers=op) as r:
            assert r.status == 503                       # routed requests wait for undrain; the canary has its own door
        async with http.post("/admin/canary", json={"prompt_token_ids": [1, 2, 3], "max_tokens": 2},
                             headers=op) as r:
            assert r.status == 200
            chunks = [msgspec.json.decode(line, type=StreamChunk) async for line in r.content]
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 2
        async with http.post("/admin/undrain", headers=op) as r:
            assert r.status == 200
        async with http.post("/internal/generate", json=body("routed-2", [1, 2, 3], max_tokens=1)) as r:
            assert r.status == 200
            await r.read()


def test_start_drained_needs_an_operator_key(monkeypatch, capsys):
    from edgeinfer.backend.server import parse_args

    monkeypatch.delenv("EDGEINFER_OPERATOR_KEY", raising=False)
    monkeypatch.setenv("EDGEINFER_INTERNAL_SECRET", "internal-secret-for-tests")
    with pytest.raises(SystemExit) as e:
        parse_args(["--start-drained"])
    assert e.value.code == 2 and "--start-drained needs --operator-key" in capsys.readouterr().err
    assert parse_args(["--start-drained", "--operator-key", "operator-key-0123456789abcdef"]).start_drained
