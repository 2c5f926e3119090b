"""The aiohttp application: one middleware (request id, errors -> OpenAI JSON, access log, metrics),
routes, and the resources in cleanup_ctx (client session, node probes, Redis)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web, web_protocol, web_server
from opentelemetry import context as otel_context

from edgeinfer.cache_store.wiring import wire_redis
from edgeinfer.gateway import (
    pipeline,
    serving_chat,
    serving_completions,
    serving_models,
    serving_responses,
    serving_tokenize,
)
from edgeinfer.gateway.config import ConfigError, GatewayConfig
from edgeinfer.gateway.context import CONTEXT, RequestContext
from edgeinfer.gateway.errors import APIError
from edgeinfer.gateway.openapi import openapi_document
from edgeinfer.gateway.state import STATE, GatewayState, build_state
from edgeinfer.gateway.tokenpool import TokenizerPool
from edgeinfer.telemetry import observability as obs

log = logging.getLogger("edgeinfer.gateway")
access_log = logging.getLogger("edgeinfer.gateway.access")
_encode = msgspec.json.Encoder().encode
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models"}


class _ParserErrorHandler(web_protocol.RequestHandler):
    """aiohttp answers what its HTTP parser rejects (a NUL in a header, a header over 8190 bytes, a bad
    request line) before any middleware runs; this handler gives those answers an OpenAI error body.
    The offending bytes (which may hold an API key) are neither echoed nor logged: only the parser's
    reason up to where it quotes them."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            super().handle_error(request, status, exc, message)   # a bug: aiohttp logs it with its traceback
        elif request.writer.output_size > 0:
            raise ConnectionError("response already started, cannot send the parser error")
        reason = _parser_reason(message or getattr(exc, "message", None) or str(exc or ""))
        log.info("malformed HTTP request from %s: %s", request.remote, reason)
        code = "request_header_fields_too_large" if status == 431 else (
            "invalid_http_request" if status < 500 else "internal_error")
        resp = _error_response(APIError(status, f"malformed HTTP request: {reason}", code=code),
                               pipeline.new_request_id(None))
        resp.force_close()
        return resp


def _parser_reason(text: str) -> str:
    # "Invalid header value char:\n\n  b'Authorization: Bearer sk-...'" -> "Invalid header value char"
    text = text.split("\n", 1)[0]
    for quote in (": b'", ': b"', " b'", ' b"'):
        text = text.split(quote, 1)[0]
    return text.strip().rstrip(":")[:200] or "malformed HTTP request"


class _Server(web_server.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _ParserErrorHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """web.AppRunner whose connections answer HTTP parser errors with OpenAI JSON (see _ParserErrorHandler)."""

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        if type(server) is not web_server.Server:   # an aiohttp that builds something else: keep its own
            log.warning("aiohttp built a %s, not a web.Server: parser errors stay plain text", type(server))
            return server
        server.__class__ = _Server
        return server


def _error_response(e: APIError, request_id: str) -> web.Response:
    return web.Response(status=e.status, body=_encode(e.body()), content_type="application/json",
                        headers={**e.headers, "x-request-id": request_id})


@web.middleware
async def edge_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every request: its RequestContext, its span (tracing on), the error mapping to OpenAI-style bodies, then its
    metrics and access-log line."""
    st: GatewayState = request.app[STATE]
    ctx = request[CONTEXT] = RequestContext(pipeline.new_request_id(request.headers.get("x-request-id")),
                                            time.perf_counter())
    task = asyncio.current_task()
    assert task is not None, "aiohttp runs each request's handler in its own task"
    st.handlers.add(task)
    rid_token = obs.request_id_var.set(ctx.request_id)
    span, span_token = _start_span(request, ctx)
    outcome = _Outcome()
    try:
        return await _mapped(request, handler, st, ctx, task, outcome)
    finally:
        st.handlers.discard(task)
        obs.request_id_var.reset(rid_token)
        trace_id = _end_span(span, span_token, ctx, outcome)
        _record(st, request, ctx, outcome, trace_id)


@dataclass
class _Outcome:
    status: int = 500
    error: str | None = None


def _start_span(request: web.Request, ctx: RequestContext):
    """The request's span, current for the handler: admission, routing, the backend calls (probes and scrapes of
    /health, /ready, /metrics make no traces). -> (span, context token), both None with tracing off."""
    if not (obs.tracing_on() and request.path.startswith(("/v1/", "/tokenize", "/detokenize"))):
        return None, None
    span = obs.tracer().start_span("gateway.request", context=obs.extract_context(request.headers),
                                   kind=obs.trace.SpanKind.SERVER,
                                   attributes={"http.request.method": request.method, "url.path": request.path,
                                               "edgeinfer.request_id": ctx.request_id})
    return span, otel_context.attach(obs.trace.set_span_in_context(span))


async def _mapped(request: web.Request, handler, st: GatewayState, ctx: RequestContext, task: asyncio.Task,
                  outcome: _Outcome) -> web.StreamResponse:
    """The handler's response, or the OpenAI-style error its failure maps to (outcome: the status and error code
    the metrics and the access log report)."""
    rid = ctx.request_id
    try:
        if st.draining and request.path.startswith("/v1/"):
            raise APIError(503, "the gateway is shutting down", code="shutting_down", headers={"retry-after": "1"})
        resp = await handler(request)
        outcome.status = resp.status
        return resp
    except APIError as e:
        if isinstance(e, pipeline.TooDeep):
            e = await e.named()
        outcome.status, outcome.error = e.status, e.code
        return _error_response(e, rid)
    except web.HTTPException as e:
        outcome.status, outcome.error = e.status, "http_error"
        if e.status < 400:
            raise
        if e.status == 404:       # no such route: OpenAI's shape, naming the path
            outcome.error = "unknown_url"
            return _error_response(APIError(404, f"Invalid URL ({request.method} {request.path})",
                                            code="unknown_url"), rid)
        if e.status == 405:
            outcome.error = "method_not_allowed"
            return _error_response(APIError(405, f"Method {request.method} is not allowed on {request.path}",
                                            code="method_not_allowed", headers={"allow": e.headers.get("allow", "")}),
                                   rid)
        return _error_response(APIError(e.status, e.reason or "error", code=str(e.status)), rid)
    except ConnectionResetError as e:
        if not _client_gone(request):
            raise                              # not the client's connection: a bug, aiohttp logs it
        outcome.status, outcome.error = 499, "client_closed"
        log.info("client closed the connection (request %s, %s %s): %s", rid, request.method, request.path, e)
        return web.Response(status=499)        # never sent: aiohttp sees the closed transport and drops it
    except asyncio.CancelledError:
        if st.cut and not _client_gone(request):    # the shutdown grace is over (_on_shutdown): end it now
            task.uncancel()
            outcome.status, outcome.error = 503, "shutting_down"
            return await _cut_response(request, rid)
        outcome.status, outcome.error = 499, "client_closed"
        if _client_gone(request):
            log.info("client closed the connection (request %s, %s %s)", rid, request.method, request.path)
        raise
    except RecursionError:     # a client's input nested past what a parser or template follows: its fault
        outcome.status, outcome.error = 400, "nesting_too_deep"
        return _error_response(APIError(400, "the request nests too deeply to be processed", code=outcome.error),
                               rid)
    except Exception as e:
        log.exception("unhandled error in %s %s (request %s)", request.method, request.path, rid)
        outcome.status, outcome.error = 500, "internal_error"
        return _error_response(APIError(500, f"internal error ({type(e).__name__}); request id {rid}",
                                        code="internal_error"), rid)


def _end_span(span, span_token, ctx: RequestContext, outcome: _Outcome) -> str | None:
    """The span's outcome attributes (counts, ids, names: never text or keys), ended; -> its trace id."""
    if span is None:
        return None
    span.set_attributes({"http.response.status_code": outcome.status, "edgeinfer.tenant": ctx.tenant,
                         "edgeinfer.model": ctx.model, "edgeinfer.node": ctx.node, "edgeinfer.route": ctx.route,
                         "edgeinfer.error": outcome.error or ""})
    if ctx.usage is not None:
        span.set_attributes({"edgeinfer.prompt_tokens": ctx.usage.prompt_tokens,
                             "edgeinfer.completion_tokens": ctx.usage.completion_tokens,
                             "edgeinfer.cached_tokens": ctx.usage.prompt_tokens_details.cached_tokens})
    if outcome.status >= 500:
        span.set_status(obs.trace.StatusCode.ERROR)
    trace_id = f"{span.get_span_context().trace_id:032x}"
    span.end()
    if span_token is not None:
        otel_context.detach(span_token)
    return trace_id


def _record(st: GatewayState, request: web.Request, ctx: RequestContext, outcome: _Outcome,
            trace_id: str | None) -> None:
    """The request's metrics (API endpoints) and its access-log line."""
    endpoint = _ENDPOINTS.get(request.path)
    if endpoint is not None:
        st.metrics.requests.labels(ctx.tenant, ctx.model, endpoint, str(outcome.status)).inc()
        st.metrics.duration.labels(ctx.tenant, ctx.model, endpoint).observe(time.perf_counter() - ctx.t0)
    if not (st.cfg.server.access_log and access_log.isEnabledFor(logging.INFO)):
        return
    rec = {"ts": round(time.time(), 3), "request_id": ctx.request_id, "method": request.method, "path": request.path,
           "status": outcome.status, "ms": round((time.perf_counter() - ctx.t0) * 1000, 3), "tenant": ctx.tenant,
           "model": ctx.model, "node": ctx.node, "route": ctx.route, "error": outcome.error, "remote": request.remote}
    if trace_id is not None:
        rec["trace_id"] = trace_id
    if ctx.usage is not None:
        rec.update(prompt_tokens=ctx.usage.prompt_tokens, completion_tokens=ctx.usage.completion_tokens,
                   cached_tokens=ctx.usage.prompt_tokens_details.cached_tokens)
    # makeRecord + handle = access_log.info without findCaller's stack walk (the caller is known);
    # args=None works (LogRecord formats only when args is truthy); typeshed wants a tuple
    access_log.handle(access_log.makeRecord(access_log.name, logging.INFO, __file__, 0, _encode(rec).decode(),
                                            None, None))  # type: ignore[arg-type]


async def _cut_response(request: web.Request, rid: str) -> web.StreamResponse:
    """A request cut by shutdown: a 503 if nothing was sent yet, else its stream's error event written
    (the RequestContext's cut_event, set by the streaming handlers once their headers are out) and the stream
    ended."""
    ctx = request[CONTEXT]
    resp = ctx.stream
    if resp is None or not resp.prepared:
        return _error_response(APIError(503, pipeline.SHUTDOWN_MESSAGE, code="shutting_down",
                                        headers={"retry-after": "1"}), rid)
    try:
        assert ctx.cut_event is not None
        await resp.write(ctx.cut_event())
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    st = request.app[STATE]
    models = {m: len(st.pool.for_model(m)) for m in st.models}
    ok = not st.draining and any(models.values())
    return web.json_response({"ready": ok, "draining": st.draining, "nodes": models}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """The open series; with the metrics or admin key, the per-tenant ones too (gateway/metrics.py)."""
    st = request.app[STATE]
    trusted = st.metrics_trusted(request)
    st.metrics.inflight.set(st.inflight)
    st.metrics.limiter_fallbacks.set(st.admission.failures)
    s = st.cfg.server
    st.metrics.set_pools([n for n in st.pool.nodes.values() if n.routable], s.autoscale_kv_target, s.autoscale_ttft_target_s)
    return web.Response(body=st.metrics.render(trusted), headers={"content-type": "text/plain; version=0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app["openapi"], content_type="application/json")


async def admin_reload(request: web.Request) -> web.Response:
    st = request.app[STATE]
    st.check_admin(request)
    try:
        n = st.reload_tenants()
    except ConfigError as e:
        raise APIError(400, f"reload failed, keeping the current tenants: {e}", code="invalid_config") from e
    return web.json_response({"reloaded": True, "tenants": n})


async def admin_nodes(request: web.Request) -> web.Response:
    st = request.app[STATE]
    st.check_admin(request)
    return web.json_response({n.node_id: {"url": n.url, "model": n.model, "ready": n.ready, "state": n.state,
                                          "routable": n.routable, "inflight": n.inflight, "load": n.load}
                              for n in st.pool.nodes.values()})


async def _resources(app: web.Application):
    st: GatewayState = app[STATE]
    sources = {name: m.tokenizer.source for name, m in st.models.items() if m.tokenizer.source}
    workers = st.cfg.server.tokenizer_workers
    pool = TokenizerPool(sources, workers) if sources and workers else None    # workers start on first use
    for m in st.models.values():
        m.pool = pool
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=60)
    st.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,   # node probes: /internal/info
                                       timeout=aiohttp.ClientTimeout(total=None), headers=st.cfg.internal_auth)
    await st.pool.refresh()
    probes = asyncio.get_running_loop().create_task(st.pool.run())
    run = getattr(st.admission, "run", None)        # Redis: refresh the stream leases this gateway holds
    leases = asyncio.get_running_loop().create_task(run()) if run is not None else None
    yield
    probes.cancel()
    if leases is not None:
        leases.cancel()
    await asyncio.gather(probes, *([leases] if leases else []), return_exceptions=True)
    await st.upstream.drain_aborts()
    if st.tasks:
        await asyncio.wait(list(st.tasks), timeout=5)
    st.upstream.close()
    st.schemas.close()
    await st.session.close()
    if pool is not None:
        for m in st.models.values():
            if m.pool is pool:
                m.pool = None
        pool.close()
    if st.redis is not None:
        await st.redis.aclose()


async def _on_shutdown(app: web.Application) -> None:
    """Listening has stopped; let running requests finish (bounded by shutdown_grace_s)."""
    st: GatewayState = app[STATE]
    st.draining = True
    deadline = time.monotonic() + st.cfg.server.shutdown_grace_s
    while st.inflight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if st.handlers:
        log.warning("shutdown grace of %.0fs over with %d requests still running; cancelling them",
                    st.cfg.server.shutdown_grace_s, len(st.handlers))
        st.cut = True
        running = list(st.handlers)
        for task in running:
            task.cancel()
        await asyncio.wait(running, timeout=5)


def create_app(cfg: GatewayConfig, *, state: GatewayState | None = None, **overrides) -> web.Application:
    if state is None:
        if cfg.server.redis_url and "redis_client" not in overrides:
            redis = wire_redis(cfg.server.redis_url, cfg.server.key_prefix, cluster=cfg.server.redis_cluster,
                               socket_timeout_s=None)  # admission: its own timeout
            overrides.setdefault("registry", redis.registry())
            overrides.setdefault("index", redis.index())
            overrides["redis_client"] = redis.client
        state = build_state(cfg, **overrides)
    app = web.Application(middlewares=[edge_middleware], client_max_size=cfg.server.max_body_bytes)
    app[STATE] = state
    app["openapi"] = _encode(openapi_document())
    app.router.add_post("/v1/chat/completions", serving_chat.chat_completions)
    app.router.add_post("/v1/completions", serving_completions.completions)
    app.router.add_get("/v1/models", serving_models.list_models)
    app.router.add_get("/v1/models/{model:.+}", serving_models.retrieve_model)
    app.router.add_post("/v1/responses", serving_responses.create_response)
    app.router.add_post("/tokenize", serving_tokenize.tokenize)
    app.router.add_post("/detokenize", serving_tokenize.detokenize)
    app.router.add_get("/tokenizer_info", serving_tokenize.tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/admin/reload", admin_reload)
    app.router.add_get("/admin/nodes", admin_nodes)
    app.cleanup_ctx.append(_resources)
    app.on_shutdown.append(_on_shutdown)
    return app
