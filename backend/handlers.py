"""The backend node's HTTP handlers and app (aiohttp): the internal API of protocol/wire.py over one LLMEngine;
backend/server.py assembles the node and runs it.

/internal/* answers only a caller holding the internal secret (the gateway and the other nodes: `authorization:
Bearer <secret>`, compared in constant time); anything else, the operator key included, is a 401 before the body is
read. The operator key opens only the operator's endpoints, /admin/*: drain, undrain, info (the rollout's health
gate) and canary (one fixed-shape generate request, no tenant, no hand-off, no grammar), so whoever holds it cannot
make a node send the internal secret anywhere (docs/RELIABILITY.md, the threat model). /health, /ready, /metrics stay
open (/metrics without tenant ids, which it shows only to the internal secret or the operator key).

Queueing: a generate stream carries a keepalive (an empty NDJSON line) every --keepalive-s without a chunk
while the engine keeps stepping, so the gateway can tell a queued request on a working node from one on a
stuck node. A request whose estimated wait for its first token (backend.engine.backlog) is over
--max-queue-wait-s is refused at once: 503 with Retry-After and error type "overloaded".
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from edgeinfer.backend.engine.engine import LLMEngine, RequestError
from edgeinfer.backend.extension import ServerExtension
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.node_config import VERSION
from edgeinfer.backend.tracing import RequestTraces
from edgeinfer.protocol.page_id import HASH_BYTES
from edgeinfer.protocol.wire import (
    AbortRequest,
    BackendInfo,
    GenerateRequest,
    SamplingParams,
    StreamChunk,
    encode,
    pages_request_decoder,
)
from edgeinfer.telemetry import observability as obs

log = logging.getLogger("edgeinfer.backend")


@dataclass
class BackendState:
    engine: LLMEngine
    metrics: BackendMetrics
    node_id: str
    version: str = VERSION
    operator_key: str | None = None
    internal_secret: str | None = None   # None only with --insecure-no-internal-auth
    state: str = "active"
    url: str = ""
    in_flight: set[str] = field(default_factory=set)
    started_at: float = field(default_factory=time.time)
    keepalive_s: float | None = 1.0      # None: no keepalive lines
    max_queue_wait_s: float | None = None  # None: no bound on the estimated queue wait
    extensions: list[ServerExtension] = field(default_factory=list)   # backend/extension.py
    parallel_node: object | None = None   # backend.parallel.node.Node of a --tensor-parallel node (rank 0)
    role: str = "both"                    # --role: prefill | decode | both (docs/DISAGGREGATION.md)
    traces: RequestTraces | None = None   # set when tracing is on (telemetry/observability.py)
    kv_gate: dict | None = None           # the KV format decision and its measurements (backend/quant/kv_gate.py)


STATE = web.AppKey("state", BackendState)


KEEPALIVE = b"\n"
MAX_PAGES_PER_REQUEST = 4096      # one /internal/kv/pages request (a decode node asks in chunks of ~96 MiB)
encode_lines = msgspec.json.Encoder().encode_lines     # one NDJSON line per chunk, each ending in b"\n"


def _error(status: int, message: str, kind: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    body: dict = {"message": message, "code": status}
    if kind is not None:
        body["type"] = kind
    return web.json_response({"error": body}, status=status, headers=headers)


def _overloaded(st: BackendState, req: GenerateRequest) -> web.Response | None:
    """503 + Retry-After when the estimated wait for this request's first token is over the bound."""
    bound = st.max_queue_wait_s
    if bound is None:
        return None
    backlog = st.engine.backlog
    wait = backlog.wait_s(len(req.prompt_token_ids))
    if wait is None or wait <= bound:
        return None
    retry = backlog.retry_after_s(len(req.prompt_token_ids), bound)
    st.metrics.overloaded.labels(st.metrics.model).inc()
    return _error(503, f"node {st.node_id} is overloaded: estimated wait for the first token {wait:.0f}s "
                       f"(max_queue_wait_s {bound:g}); retry after {retry}s", "overloaded",
                  {"retry-after": str(retry)})


async def generate(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    if st.state != "active":
        return _error(503, f"node {st.node_id} is {st.state}; not accepting new requests")
    try:
        req = msgspec.json.decode(await request.read(), type=GenerateRequest)
    except msgspec.ValidationError as e:
        return _error(422, f"invalid generate request: {e}")
    except msgspec.DecodeError as e:
        return _error(400, f"malformed JSON body: {e}")
    return await _traced_generate(request, st, req)


class CanaryRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /admin/canary: what an operator may choose of a canary (ops rollout); the rest is fixed."""
    prompt_token_ids: list[int]
    max_tokens: int = 4
    model: str = ""


MAX_CANARY_TOKENS = 64
MAX_CANARY_PROMPT = 256


async def admin_canary(request: web.Request) -> web.StreamResponse:
    """One greedy generate request from the operator, on an active or drained node: a short prompt of token ids,
    at most MAX_CANARY_TOKENS, in the "ops-canary" namespace, with no tenant, no kv_source, no grammar."""
    if not _operator_ok(request):
        return _error(401, "operator key required")
    st = request.app[STATE]
    try:
        c = msgspec.json.decode(await request.read(), type=CanaryRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return _error(400, f"invalid canary request: {e}")
    if not 1 <= len(c.prompt_token_ids) <= MAX_CANARY_PROMPT or not 1 <= c.max_tokens <= MAX_CANARY_TOKENS:
        return _error(400, f"invalid canary request: expected 1..{MAX_CANARY_PROMPT} prompt token ids and max_tokens "
                           f"1..{MAX_CANARY_TOKENS}, got {len(c.prompt_token_ids)} and {c.max_tokens}")
    req = GenerateRequest(f"ops-canary-{uuid.uuid4().hex[:12]}", c.prompt_token_ids,
                          SamplingParams(max_tokens=c.max_tokens, temperature=0.0, ignore_eos=True),
                          cache_namespace="ops-canary", model=c.model)
    return await _traced_generate(request, st, req)


async def admin_info(request: web.Request) -> web.Response:
    """/internal/info for the operator (the rollout's health gate: version and node id)."""
    if not _operator_ok(request):
        return _error(401, "operator key required")
    return await info(request)


async def _traced_generate(request: web.Request, st: BackendState, req: GenerateRequest) -> web.StreamResponse:
    token = obs.request_id_var.set(req.request_id)     # JSON log lines name the request
    try:
        if st.traces is None:
            return await _generate(request, st, req)
        attrs = {"edgeinfer.request_id": req.request_id, "edgeinfer.node": st.node_id, "edgeinfer.model":
                 st.engine.model_name, "edgeinfer.prompt_tokens": len(req.prompt_token_ids),
                 "edgeinfer.max_tokens": req.sampling.max_tokens, "edgeinfer.prefill_only": req.prefill_only}
        with obs.span("backend.generate", attrs, context=obs.extract_context(request.headers),
                      kind=obs.trace.SpanKind.SERVER) as sp:
            try:
                resp = await _generate(request, st, req)
                sp.set_attribute("http.response.status_code", resp.status)
                return resp
            finally:
                st.traces.spans_for(req.request_id, sp)
    finally:
        obs.request_id_var.reset(token)


async def _generate(request: web.Request, st: BackendState, req: GenerateRequest) -> web.StreamResponse:
    engine = st.engine
    try:
        engine.validate(req)
    except RequestError as e:
        return _error(e.code, str(e))
    if (refused := _overloaded(st, req)) is not None:
        return refused
    if req.prefill_only:    # the first hop of a disaggregated request: the prompt's KV, one chunk, no token
        req = msgspec.structs.replace(req, sampling=SamplingParams(max_tokens=1, temperature=0.0), constraint=None,
                                      kv_source=None)
    st.in_flight.add(req.request_id)   # counted from admission, so a drain never sees it as idle
    try:
        for ext in st.extensions:      # e.g. the page store: fetch + verify + upload pages beyond the local cache
            with obs.span("backend.kv_fetch", {"edgeinfer.request_id": req.request_id}) as sp:
                got = await ext.before_generate(request.app, req)
                if isinstance(got, int):
                    sp.set_attribute("edgeinfer.pages_uploaded", got)
        resp = web.StreamResponse(headers={"content-type": "application/x-ndjson", "x-node-id": st.node_id})
        try:
            await resp.prepare(request)
        except ConnectionResetError as e:     # the caller left before the headers: nothing was started
            log.info("request %s: the caller left before the response headers (%s)", req.request_id, e)
            return resp
        gen = engine.stream_batches(req, st.keepalive_s)
        try:
            async for batch in gen:       # every chunk the engine delivered so far: one write
                if batch is not None and req.prefill_only:
                    batch = _prefilled(batch)
                    if not batch:
                        continue
                await resp.write(KEEPALIVE if batch is None else encode_lines(batch))
        except RequestError as e:
            await resp.write(encode(StreamChunk(req.request_id, finish_reason="error", error=str(e),
                                                error_code=e.code)) + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            engine.abort(req.request_id)
            raise
        finally:
            await gen.aclose()
    finally:
        st.in_flight.discard(req.request_id)
    await resp.write_eof()
    return resp


def _prefilled(batch: list[StreamChunk]) -> list[StreamChunk]:
    """A prefill-only request's chunks as its caller gets them: nothing but the last (finish_reason "prefilled",
    the usage) or an error."""
    out = []
    for c in batch:
        if c.error is not None:
            out.append(c)
        elif c.finish_reason is not None:
            out.append(StreamChunk(c.request_id, finish_reason="prefilled" if c.finish_reason != "abort" else "abort",
                                   usage=c.usage))
    return out


async def kv_pages(request: web.Request) -> web.StreamResponse:
    """The sealed pages of a chain this node holds, for a decode node (backend/page_store/handoff.py)."""
    st = request.app[STATE]
    try:
        req = pages_request_decoder.decode(await request.read())
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return _error(400, f"invalid page request: {e}")
    most = min(MAX_PAGES_PER_REQUEST, -(-st.engine.max_model_len // st.engine.cfg.page_size))   # one context
    if len(req.hashes) > most or any(len(h) != HASH_BYTES for h in req.hashes):
        return _error(400, f"invalid page request: expected at most {most} page hashes (one context) of {HASH_BYTES} "
                           f"bytes each, got {len(req.hashes)}")
    if len(set(req.hashes)) != len(req.hashes):
        return _error(400, f"invalid page request: {len(req.hashes) - len(set(req.hashes))} page hashes repeated; "
                           "a request names each page of one chain once")
    handoff = next((ext.handoff for ext in st.extensions if ext.handoff is not None), None)
    if handoff is None:
        return _error(404, f"node {st.node_id} has no page hand-off (no page store and --role both)")
    resp = web.StreamResponse(headers={"content-type": "application/octet-stream"})   # chunked: streamed
    await resp.prepare(request)
    async for piece in handoff.send(req.hashes):
        await resp.write(piece)
    await resp.write_eof()
    return resp


async def abort(request: web.Request) -> web.Response:
    try:
        req = msgspec.json.decode(await request.read(), type=AbortRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return _error(400, f"invalid abort request: {e}")
    return web.json_response({"aborted": request.app[STATE].engine.abort(req.request_id)})


def backend_info(st: BackendState) -> BackendInfo:
    e = st.engine
    return BackendInfo(node_id=st.node_id, model=e.model_name, model_fingerprint=e.fingerprint,
                       kv_format=e.kv_format, page_size=e.cfg.page_size, max_model_len=e.max_model_len,
                       version=st.version, state=st.state, role=st.role, kv_gate=st.kv_gate)


async def info(request: web.Request) -> web.Response:
    return web.Response(body=encode(backend_info(request.app[STATE])), content_type="application/json")


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def load_report(st: BackendState) -> dict:
    e = st.engine
    b = e.blocks
    return {"node_id": st.node_id, "state": st.state, "version": st.version, "model": e.model_name,
            "running": e.num_running, "waiting": e.num_waiting, "in_flight": len(st.in_flight),
            "kv_pages_used": b.num_used, "kv_pages_total": b.num_pages, "queue_wait_s": _rounded(e.backlog.wait_s(0)),
            "prefill_tokens_queued": e.backlog.queued(), "role": st.role,
            "prefix_cache_hit_rate": b.hits / max(b.queries, 1)}


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if not st.engine.is_alive():
        return _error(503, "engine thread is not running")
    return web.json_response({"status": "ok", **load_report(st)})


async def ready(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.state != "active":
        return _error(503, f"node is {st.state}")
    return web.json_response({"status": "ready", **load_report(st)})


async def metrics(request: web.Request) -> web.Response:
    """Open, without tenant ids; the per-tenant series too for the gateway's secret or the operator key."""
    st = request.app[STATE]
    st.metrics.on_step(st.engine, None, 0.0)
    trusted = _operator_ok(request) or (st.internal_secret is not None and _bearer_is(request, st.internal_secret))
    return web.Response(body=st.metrics.render(trusted), content_type="text/plain")


def _bearer_is(request: web.Request, key: str) -> bool:
    got = request.headers.get("authorization", "")
    return hmac.compare_digest(got.encode(errors="surrogateescape"), f"Bearer {key}".encode())  # non-UTF-8: 401


def _operator_ok(request: web.Request) -> bool:
    key = request.app[STATE].operator_key
    return key is not None and key != "" and _bearer_is(request, key)


def _internal_ok(request: web.Request) -> bool:
    """The internal secret only: the operator key is not an internal credential (see the module docstring)."""
    secret = request.app[STATE].internal_secret
    if secret is None:
        return True
    return _bearer_is(request, secret)


@web.middleware
async def internal_auth(request: web.Request, handler):
    resource = request.match_info.route.resource    # the matched route, not the raw path text
    if resource is not None and resource.canonical.startswith("/internal/") and not _internal_ok(request):
        return _error(401, "internal API: missing or wrong internal secret (authorization: Bearer <secret>)")
    return await handler(request)


async def _set_state(request: web.Request, state: str) -> web.Response:
    if not _operator_ok(request):
        return _error(401, "operator key required")
    st = request.app[STATE]
    st.state = state
    for ext in st.extensions:
        await (ext.on_drain(request.app) if state == "draining" else ext.on_undrain(request.app))
    return web.json_response(load_report(st))


async def admin_drain(request: web.Request) -> web.Response:
    return await _set_state(request, "draining")


async def admin_undrain(request: web.Request) -> web.Response:
    return await _set_state(request, "active")


def make_app(state: BackendState) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[internal_auth])
    app[STATE] = state

    async def lifecycle(app: web.Application):
        state.engine.start()
        for ext in state.extensions:
            await ext.start(app)
        yield
        for ext in reversed(state.extensions):
            await ext.stop(app)
        state.engine.stop()
        if state.parallel_node is not None:   # the other ranks: told to stop, then their processes ended
            node = state.parallel_node
            node.stopping = True  # type: ignore[attr-defined]
            if not getattr(node, "failed", False):
                state.engine.model.stop_workers()
            node.stop()  # type: ignore[attr-defined]

    app.cleanup_ctx.append(lifecycle)
    app.add_routes([
        web.post("/internal/generate", generate),
        web.post("/internal/abort", abort),
        web.post("/internal/kv/pages", kv_pages),
        web.get("/internal/info", info),
        web.get("/health", health),
        web.get("/ready", ready),
        web.get("/metrics", metrics),
        web.post("/admin/drain", admin_drain),
        web.post("/admin/undrain", admin_undrain),
        web.get("/admin/info", admin_info),
        web.post("/admin/canary", admin_canary),
    ])
    return app


