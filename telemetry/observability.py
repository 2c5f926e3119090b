"""Traces and logs as operators expect them, shared by the gateway, the backend and `serve`.

Tracing (OpenTelemetry): off unless configured. `setup_tracing(service)` installs an SDK TracerProvider when
`--otlp-endpoint` / OTEL_EXPORTER_OTLP_ENDPOINT names a collector (the OTLP/HTTP exporter, an optional install:
`pip install edgeinfer[otlp]`) or when a test hands it an exporter; otherwise the API's no-op tracer answers and a
span costs a function call. W3C `traceparent` travels from the client through the gateway to the backend
(`inject_headers` / `extract_context`: the global propagator, tracecontext + baggage).

Span names (docs/OPERATIONS.md "Traces"): gateway `gateway.request` > `gateway.admission`, `gateway.route`,
`gateway.prefill_hop`, `gateway.backend_call`; backend `backend.generate` > `backend.kv_fetch`, `backend.queue`,
`backend.prefill`, `backend.decode`; `backend.kv_integrity_failure` (its own trace: found on the engine thread).
Attributes never hold prompt or output text, API keys, page keys or tenant keys: counts, ids, names, outcomes.

Logs: `configure_logging(fmt, level)`; fmt "json" writes one JSON object per line (ts, level, logger, msg, and the
request_id / trace_id / span_id of the request being served where there is one), "text" the usual lines.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("edgeinfer_request_id", default=None)
TRACER_NAME = "edgeinfer"

_provider = None      # this process's SDK TracerProvider once tracing is on


def setup_tracing(service: str, endpoint: str | None = None, exporter: Any = None) -> bool:
    """Tracing on for this process when `endpoint` (else OTEL_EXPORTER_OTLP_ENDPOINT) or `exporter` is given: an SDK
    TracerProvider with resource service.name = `service`, spans batched to the exporter (a test's exporter:
    exported as each span ends). Returns whether tracing is on. Raises RuntimeError naming the missing package when
    an endpoint is configured but the OTLP exporter is not installed."""
    global _provider
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    if exporter is None and endpoint is None:
        return _provider is not None
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415 - the SDK only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor  # noqa: PLC0415

    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
        except ImportError as e:
            raise RuntimeError(f"OTLP endpoint {endpoint!r} configured but the exporter is not installed: "
                               "pip install 'edgeinfer[otlp]' (opentelemetry-exporter-otlp-proto-http)") from e
        url = (endpoint or "").rstrip("/")
        processor: Any = BatchSpanProcessor(OTLPSpanExporter(endpoint=url if url.endswith("/v1/traces")
                                                             else url + "/v1/traces"))
    else:
        processor = SimpleSpanProcessor(exporter)
    if _provider is None:    # this module's own provider, not the global one: shutdown_tracing() can turn it off
        _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    _provider.add_span_processor(processor)
    return True


def shutdown_tracing() -> None:
    """Flush and end tracing in this process (spans after this are no-ops)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracing_on() -> bool:
    return _provider is not None


_NOOP = trace.NoOpTracer()


def tracer() -> trace.Tracer:
    return _provider.get_tracer(TRACER_NAME) if _provider is not None else _NOOP


def extract_context(headers: Any) -> Context:
    """The caller's trace context from W3C `traceparent` / `tracestate` headers (an empty context without them)."""
    return propagate.extract(headers)


def inject_headers(headers: dict[str, str]) -> dict[str, str]:
    """`headers` with the current span's `traceparent` (and `tracestate`) added, for a call to the next hop."""
    if _provider is not None:
        propagate.inject(headers)
    return headers


def monotonic_to_ns(t: float) -> int:
    """A time.monotonic() reading as epoch nanoseconds (span start/end times recorded on the engine thread)."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


@contextmanager
def span(name: str, attributes: dict[str, Any] | None = None, context: Context | None = None,
         kind: trace.SpanKind = trace.SpanKind.INTERNAL) -> Iterator[trace.Span]:
    """A span made current for the block (a no-op span while tracing is off)."""
    with tracer().start_as_current_span(name, context=context, kind=kind,
                                        attributes=attributes or {}) as s:
        yield s


def past_span(name: str, start: float, end: float, attributes: dict[str, Any] | None = None) -> None:
    """A child of the current span for an interval already over, in time.monotonic() readings."""
    if _provider is None or end < start:
        return
    s = tracer().start_span(name, start_time=monotonic_to_ns(start), attributes=attributes or {})
    s.end(end_time=monotonic_to_ns(end))


def current_ids() -> tuple[str | None, str | None]:
    """(trace_id, span_id) of the current span as hex, or (None, None)."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None, None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, request_id, trace_id, span_id (when known), exc."""

    passthrough = ("edgeinfer.gateway.access",)     # already one JSON object per record (the access log)

    def format(self, record: logging.LogRecord) -> str:
        if record.name in self.passthrough:
            return record.getMessage()
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                               "msg": record.getMessage()}
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            out["request_id"] = rid
        trace_id, span_id = current_ids()
        if trace_id:
            out["trace_id"], out["span_id"] = trace_id, span_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(fmt: str = "text", level: str | int = "INFO",
                      text_format: str = "%(asctime)s %(name)s %(levelname)s %(message)s") -> None:
    """Root logging to stderr, as text lines or JSON lines (`fmt`); replaces handlers set before."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is invalid: expected one of {', '.join(LOG_FORMATS)}")
    if isinstance(level, str):
        if level.upper() not in LOG_LEVELS:
            raise ValueError(f"log level {level!r} is invalid: expected one of {', '.join(LOG_LEVELS)}")
        level = level.upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else logging.Formatter(text_format))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
