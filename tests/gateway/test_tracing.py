"""OpenTelemetry traces (telemetry/observability.py) through the real stack in one process, exported to the SDK's
in-memory exporter: the official openai client sends a W3C traceparent -> the gateway (its own server thread) ->
the real backend app on SmolLM2 (served in-process on loopback). One request gives one trace: the client's trace id
everywhere, the expected spans parented as documented, the expected attributes, and no prompt text, output text or
key in any attribute. JSON log lines carry the request id and the trace id."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import aiohttp
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.server import BackendState, enable_tracing
from edgeinfer.telemetry import observability as obs
from tests.gateway.conftest import DEMO_KEY, parsed, tenant
from tests.support.inproc import serve

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SECRET_WORD = "zanzibarquokka"


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    assert obs.setup_tracing("edgeinfer-test", exporter=exp)
    try:
        yield exp
    finally:
        obs.shutdown_tracing()
    assert not obs.tracing_on()


@pytest.mark.slow
async def test_one_request_gives_one_trace_from_the_client_to_the_engine(exporter, harness, smol_model,
                                                                         smol_tokenizer, smol_dir):
    engine = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=128), model_name="smol")
    metrics = BackendMetrics("smol")
    engine.observers.append(metrics)
    st = BackendState(engine=engine, metrics=metrics, node_id="n-trace")
    enable_tracing(st)
    async with serve(st) as http:
        cfg = parsed({"server": {"page_seed": "trace-seed", "health_interval_s": 0.2},
                      "models": [{"name": "smol", "tokenizer": str(smol_dir)}],
                      "nodes": [{"id": "n-trace", "url": str(http._base_url).rstrip("/"), "model": "smol"}],
                      "tenants": [tenant()]})
        gw = harness.gateway([], cfg=cfg)
        async with aiohttp.ClientSession() as s:     # the gateway's first probe of the node answered (async: the
            for _ in range(600):                     # backend answers on this loop)
                async with s.get(gw.url + "/ready") as ready:
                    if ready.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert ready.status == 200, "the gateway never saw the backend"
        assert not exporter.get_finished_spans()     # probes make no traces
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=DEMO_KEY, max_retries=0, timeout=120)
        r = await client.chat.completions.create(
            model="smol", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"What is the capital of France? {SECRET_WORD}"}],
            extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        await client.close()
    answer = r.choices[0].message.content
    spans = exporter.get_finished_spans()
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    want = {"gateway.request", "gateway.admission", "gateway.route", "gateway.prefill_hop", "gateway.backend_call",
            "backend.generate", "backend.queue", "backend.prefill", "backend.decode"}
    assert want <= set(by_name), sorted(by_name)
    assert {f"{s.context.trace_id:032x}" for s in spans} == {TRACE_ID}     # one trace: the client's
    one = {name: by_name[name][0] for name in want}
    assert all(len(by_name[name]) == 1 for name in want)
    assert f"{one['gateway.request'].parent.span_id:016x}" == CLIENT_SPAN
    for child in ("gateway.admission", "gateway.route", "gateway.prefill_hop", "gateway.backend_call"):
        assert one[child].parent.span_id == one["gateway.request"].context.span_id, child
    assert one["backend.generate"].parent.span_id == one["gateway.backend_call"].context.span_id
    for child in ("backend.queue", "backend.prefill", "backend.decode"):
        assert one[child].parent.span_id == one["backend.generate"].context.span_id, child
    assert one["backend.queue"].end_time <= one["backend.prefill"].start_time + 1_000_000      # in order (1 ms)
    assert one["backend.prefill"].end_time <= one["backend.decode"].start_time + 1_000_000
    req, gen = one["gateway.request"].attributes, one["backend.generate"].attributes
    assert req["http.response.status_code"] == 200 and req["edgeinfer.model"] == "smol"
    assert req["edgeinfer.node"] == "n-trace" and req["edgeinfer.completion_tokens"] == r.usage.completion_tokens
    assert gen["edgeinfer.prompt_tokens"] == r.usage.prompt_tokens and gen["edgeinfer.node"] == "n-trace"
    assert gen["edgeinfer.completion_tokens"] == r.usage.completion_tokens
    assert one["gateway.admission"].attributes["edgeinfer.allowed"] is True
    assert one["gateway.route"].attributes["edgeinfer.node"] == "n-trace"
    assert one["gateway.prefill_hop"].attributes["edgeinfer.outcome"] == "colocated"
    text = json.dumps([dict(s.attributes) for s in spans] + [[dict(e.attributes) for e in s.events] for s in spans])
    for secret in (SECRET_WORD, "capital", DEMO_KEY, answer.strip()[:12] or "x" * 50):
        assert secret not in text, secret


async def test_without_tracing_nothing_is_recorded_and_the_tracer_is_a_noop():
    assert not obs.tracing_on()
    with obs.span("x") as s:
        assert not s.get_span_context().is_valid
    assert obs.inject_headers({}) == {}


def test_json_log_lines_carry_the_request_and_trace_ids(exporter):
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(obs.JsonLogFormatter())
    log = logging.getLogger("edgeinfer.test.json")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        token = obs.request_id_var.set("req-123")
        with obs.span("work") as sp:
            log.info("hello %s", "there")
        obs.request_id_var.reset(token)
        log.warning("outside")
    finally:
        log.removeHandler(handler)
    first, second = (json.loads(line) for line in buf.getvalue().splitlines())
    assert first["msg"] == "hello there" and first["level"] == "INFO" and first["request_id"] == "req-123"
    assert first["trace_id"] == f"{sp.get_span_context().trace_id:032x}" and first["logger"] == "edgeinfer.test.json"
    assert second["msg"] == "outside" and "request_id" not in second and "trace_id" not in second
    access = logging.LogRecord("edgeinfer.gateway.access", logging.INFO, __file__, 0, '{"status": 200}', None, None)
    assert obs.JsonLogFormatter().format(access) == '{"status": 200}'      # already a JSON object: as is


def test_a_configured_endpoint_without_the_exporter_is_named(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_otlp(name, *a, **kw):
        if name.startswith("opentelemetry.exporter.otlp"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_otlp)
    with pytest.raises(RuntimeError, match="edgeinfer\\[otlp\\]"):
        obs.setup_tracing("x", endpoint="http://127.0.0.1:4318")
    assert not obs.tracing_on()
    with pytest.raises(ValueError, match="log format 'xml'"):
        obs.configure_logging("xml")
