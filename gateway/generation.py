"""Fan-out of one API request into backend generate streams: routing, retry before the first byte,
merging the n streams, abort on exit.

A Run is one choice (one backend request). `start_all` routes and opens every run, retrying each on
another node while nothing was received; once a run has its first chunk it is pinned to its node.
Leaving `runs_open` for any reason (client gone, error, shutdown) aborts every run not finished.

Prefill/decode disaggregation (docs/DISAGGREGATION.md): when the model's pool has `--role prefill` nodes, a run
is two hops. The decode node is ranked first (prefix hits, load, KV occupancy, session affinity: routing.Router.
rank over the decode/both nodes). If it would compute fewer than `disagg_min_prefill_tokens` prompt tokens (a short
or mostly cached prompt), or the tenant's pages are never cached (retain = false), it prefills itself. Otherwise
the prefill node ranked best by tokens (Router.rank_prefill) gets a `prefill_only` request and answers one
"prefilled" chunk once the prompt's KV is in its pool; the decode request then names it (`kv_source`) and the
decode node pulls and verifies the pages before it schedules the request. The prefill hop is bounded by
`disagg_prefill_timeout_s`; a failed, refused or timed-out hop is counted and the run goes on without it (the
decode node computes what it did not get). The client sees one stream; its cached_tokens are the prefill side's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from edgeinfer.gateway.errors import APIError
from edgeinfer.gateway.nodes import Node
from edgeinfer.gateway.routing import Choice
from edgeinfer.gateway.upstream import BackendRejected, Overloaded, Retryable, UpstreamBroken, UpstreamStream
from edgeinfer.protocol.wire import (
    Constraint,
    GenerateRequest,
    KVSource,
    SamplingParams,
    StreamChunk,
    TenantSpec,
    Usage,
)
from edgeinfer.telemetry import observability as obs

log = logging.getLogger(__name__)


@dataclass
class Run:
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    request_id: str
    stream: UpstreamStream | None = None
    first: StreamChunk | None = None
    choice: Choice | None = None
    node: Node | None = None
    tried: list[str] = field(default_factory=list)
    constraint: Constraint | None = None      # response_format / tool_choice grammar (gateway/structured.py)
    constraint_param: str | None = None       # the request field it came from: named in a 400 when it fails
    handoff: Handoff | None = None            # the prefill hop, when disaggregated (decided once per run)
    discard_output: bool = False              # max_tokens 0 (completions' echo): the node's one token is dropped


@dataclass
class Handoff:
    outcome: str                  # handed_off | skipped_short | skipped_no_retain | prefill_failed | prefill_timeout
    source: KVSource | None = None    # the prefill node holding the KV (handed_off only)
    cached_tokens: int = 0        # the prefill side's prefix hits: what the client's usage reports


@dataclass
class Target:
    model: str
    namespace: str
    session: str = ""
    tenant: TenantSpec | None = None


async def start(st, target: Target, run: Run) -> None:
    cfg = st.cfg.server
    last: Exception | None = None
    refusals: list[Overloaded] = []
    greq = GenerateRequest(run.request_id, run.prompt_ids, run.sampling, target.namespace, target.model,
                           target.tenant, constraint=run.constraint)
    for _ in range(cfg.max_attempts):
        nodes = [n for n in st.pool.for_model(target.model) if n.node_id not in run.tried and n.role != "prefill"]
        if not nodes:
            break
        with obs.span("gateway.route", {"edgeinfer.model": target.model, "edgeinfer.candidates": len(nodes)}) as sp:
            choice = (await st.router.rank(target.model, target.namespace, run.prompt_ids, nodes, target.session))[0]
            sp.set_attributes({"edgeinfer.node": choice.node.node_id, "edgeinfer.decision": choice.decision,
                               "edgeinfer.cached_pages": choice.cached_pages})
        node = choice.node
        if run.handoff is None:
            with obs.span("gateway.prefill_hop") as sp:
                run.handoff = await prefill_hop(st, target, run, choice)
                sp.set_attribute("edgeinfer.outcome", run.handoff.outcome if run.handoff is not None else "colocated")
        greq.kv_source = run.handoff.source if run.handoff is not None else None
        run.tried.append(node.node_id)
        node.inflight += 1
        try:
            with obs.span("gateway.backend_call", {"edgeinfer.node": node.node_id,
                                                   "edgeinfer.request_id": greq.request_id}):
                run.stream, run.first = await st.upstream.open(node, greq)
        except Overloaded as e:        # a busy node, not a failed one: not marked down
            node.inflight -= 1
            refusals.append(e)
            last = e
            continue
        except Retryable as e:
            node.inflight -= 1
            node.mark_failed()
            st.metrics.retries.labels(target.model, node.node_id).inc()
            last = e
            continue
        except BackendRejected as e:
            node.inflight -= 1
            raise APIError(e.status, str(e), code=e.code, param=run.constraint_param if e.grammar else None) from e
        except BaseException:
            node.inflight -= 1
            raise
        run.choice, run.node = choice, node
        st.metrics.routing.labels(target.model, choice.decision).inc()
        return
    if refusals and len(refusals) == len(run.tried):
        retry = min(e.retry_after_s for e in refusals)
        raise APIError(503, f"every backend for model {target.model!r} is overloaded (its queue would hold this "
                            f"request too long; tried {len(run.tried)} node(s)): {refusals[-1]}",
                       code="overloaded", headers={"retry-after": str(max(1, retry))})
    detail = f": last error: {last}" if last else ""
    raise APIError(503, f"no healthy backend for model {target.model!r} (tried {len(run.tried)} "
                        f"node(s){detail})", code="backend_unavailable", headers={"retry-after": "1"})


async def prefill_hop(st, target: Target, run: Run, decode: Choice) -> Handoff | None:
    """The first hop of a disaggregated run (see the module docstring); None when the pool has no prefill node
    for the decode node's page format (colocated: nothing counted)."""
    cfg = st.cfg.server
    info = decode.node.info
    assert info is not None   # routable nodes have info
    fmt = (info.model_fingerprint, info.kv_format, info.page_size)
    prefill = [n for n in st.pool.for_model(target.model) if n.role == "prefill" and n.info is not None
               and (n.info.model_fingerprint, n.info.kv_format, n.info.page_size) == fmt]
    if not prefill:
        return None
    uncached = len(run.prompt_ids) - decode.cached_pages * info.page_size
    if target.tenant is not None and not target.tenant.retain:
        return _counted(st, target, Handoff("skipped_no_retain"))
    if uncached < cfg.disagg_min_prefill_tokens:
        return _counted(st, target, Handoff("skipped_short"))
    choice = (await st.router.rank_prefill(target.model, target.namespace, run.prompt_ids, prefill))[0]
    node = choice.node
    preq = GenerateRequest(f"{run.request_id}-prefill", run.prompt_ids, SamplingParams(max_tokens=1, temperature=0.0),
                           target.namespace, target.model, target.tenant, prefill_only=True)
    pending = len(run.prompt_ids) - choice.cached_pages * info.page_size
    node.prefill_pending += pending
    node.inflight += 1
    stream: UpstreamStream | None = None
    try:
        async with asyncio.timeout(cfg.disagg_prefill_timeout_s):
            stream, chunk = await st.upstream.open(node, preq)
            while chunk is not None and chunk.finish_reason is None and chunk.error is None:
                chunk = await stream.next()
    except TimeoutError:
        return _counted(st, target, Handoff("prefill_timeout"), node, "timed out")
    except (Retryable, UpstreamBroken) as e:
        if not isinstance(e, Overloaded):
            node.mark_failed()
        return _counted(st, target, Handoff("prefill_failed"), node, str(e))
    except BackendRejected as e:
        return _counted(st, target, Handoff("prefill_failed"), node, str(e))
    finally:
        node.prefill_pending -= pending
        node.inflight -= 1
        if stream is not None:
            stream.close()     # aborts on the prefill node unless it finished (client gone, timeout, error)
    if chunk is None or chunk.finish_reason != "prefilled":
        why = chunk.error if chunk is not None and chunk.error else f"it ended with {chunk!r}"
        return _counted(st, target, Handoff("prefill_failed"), node, why)
    cached = clamp_claim(chunk.usage.cached_tokens if chunk.usage is not None else 0, len(run.prompt_ids),
                         "cached_tokens", st.metrics.usage_clamp(target.model))   # held to the prompt sent
    return _counted(st, target, Handoff("handed_off", KVSource(node.node_id, node.url), cached))


def _counted(st, target: Target, h: Handoff, node: Node | None = None, why: str = "") -> Handoff:
    st.metrics.disaggregated.labels(target.model, h.outcome).inc()
    if node is not None and why:
        log.warning("prefill hop on node %s: %s (%s); the decode node computes the prompt", node.node_id, h.outcome,
                    why)
    return h


def clamp_claim(value: int, most: int, name: str, on_clamp: Callable[[str], None] | None) -> int:
    """A node's count held to [0, most]; a correction is reported to on_clamp by the field's name."""
    if 0 <= value <= most:
        return value
    if on_clamp is not None:
        on_clamp(name)
    return min(max(value, 0), most)


def checked_usage(run: Run, u: Usage, on_clamp: Callable[[str], None] | None = None) -> Usage:
    """A node's usage claim held to what the gateway knows: the prompt is the ids it sent, cached tokens are at
    most the prompt, completion tokens at most max_tokens. A claim outside is corrected and reported (a broken
    or hostile node must not reach the tenant's bill, the access log or the per-tenant metrics)."""
    prompt = len(run.prompt_ids)
    if u.prompt_tokens != prompt and on_clamp is not None:
        on_clamp("prompt_tokens")
    completion = clamp_claim(u.completion_tokens, max(run.sampling.max_tokens, 0), "completion_tokens", on_clamp)
    return Usage(prompt, completion, clamp_claim(u.cached_tokens, prompt, "cached_tokens", on_clamp))


def finish(st, run: Run) -> None:
    if run.stream is None:
        return
    run.stream.close()
    if run.node is not None:
        run.node.inflight -= 1
        run.node = None


@asynccontextmanager
async def runs_open(st, target: Target, runs: list[Run]):
    try:
        if len(runs) == 1:
            await start(st, target, runs[0])
        else:
            results = await asyncio.gather(*(start(st, target, r) for r in runs), return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException):
                    raise res
        yield runs
    finally:
        for r in runs:
            finish(st, r)


async def _chunks(run: Run) -> AsyncIterator[StreamChunk]:
    assert run.stream is not None and run.first is not None
    chunk: StreamChunk | None = run.first
    while chunk is not None:
        yield chunk
        if chunk.finish_reason is not None or chunk.error is not None:
            return
        chunk = await run.stream.next()
    raise UpstreamBroken(f"node {run.stream.node.node_id} closed the stream without a final chunk")


def more_ready(runs: list[Run]) -> bool:
    """The next chunk of a single run is already buffered: a relay can hold its write and send both at once.
    (Several runs are merged through a queue: always False.)"""
    return len(runs) == 1 and runs[0].stream is not None and runs[0].stream.ready()


async def merged(runs: list[Run]) -> AsyncIterator[tuple[Run, StreamChunk, float]]:
    """(run, chunk, arrival time) in arrival order; UpstreamBroken propagates."""
    if len(runs) == 1:
        async for c in _chunks(runs[0]):
            yield runs[0], c, time.perf_counter()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run) -> None:
        try:
            async for c in _chunks(run):
                queue.put_nowait((run, c, time.perf_counter()))
            queue.put_nowait((run, None, 0.0))
        except UpstreamBroken as e:
            queue.put_nowait((run, e, 0.0))

    tasks = [asyncio.ensure_future(pump(r)) for r in runs]
    try:
        live = len(runs)
        while live:
            run, item, t = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield run, item, t
    finally:
        for task in tasks:
            task.cancel()
