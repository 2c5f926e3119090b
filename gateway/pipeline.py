"""What every generating endpoint shares (SGLang's serving_base): the body read and decoded under the gateway's
limits, the served model and its access check, sampling fields -> SamplingParams (one place), admission and the
job's budgets (Job), the runs' execution, streamed as SSE or collected, and the routing affinity key. The
endpoints: serving_chat.py, serving_completions.py, serving_responses.py, serving_tokenize.py, serving_models.py."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from edgeinfer.gateway.admission import Lease
from edgeinfer.gateway.config import TenantConfig
from edgeinfer.gateway.context import context
from edgeinfer.gateway.errors import APIError, bad_value, from_validation_error
from edgeinfer.gateway.generation import Run, Target, checked_usage, merged, more_ready, runs_open
from edgeinfer.gateway.nesting import deep_field
from edgeinfer.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    PromptTokensDetails,
    UsageInfo,
    encode,
    logit_bias_ids,
    temperature_of,
    top_p_of,
)
from edgeinfer.gateway.served_model import ServedModel
from edgeinfer.gateway.state import STATE, GatewayState
from edgeinfer.gateway.structured import SchemaLimits, check_depth
from edgeinfer.gateway.tools import ToolPlan, ToolStream, split_output
from edgeinfer.gateway.upstream import GRAMMAR_FAILED, UpstreamBroken, error_code_name
from edgeinfer.protocol.wire import Constraint, SamplingParams, StreamChunk
from edgeinfer.telemetry import observability as obs

_SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
_DONE = b"data: [DONE]\n\n"
SHUTDOWN_MESSAGE = "the gateway is shutting down: this request was cut at the end of its shutdown grace"


async def read_body(request: web.Request, st: GatewayState) -> bytes:
    limit = st.cfg.server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    try:
        if request.content.is_eof():  # the whole body came with the head: read() cannot wait
            return await request.read()
        async with asyncio.timeout(st.cfg.server.body_read_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large") from e
    except web.RequestPayloadError as e:    # the body's framing or content-encoding is broken
        request.content.feed_eof()          # aiohttp would read the rest of a broken body after the answer
        request.protocol.close()            # ... and the connection's state is unknown: close it after
        if isinstance(e.__cause__, ContentEncodingError):
            raise APIError(400, f"request body is not valid for content-encoding "
                                f"{request.headers.get('content-encoding', '')!r}", code="invalid_content_encoding") from e
        raise APIError(400, f"malformed request body: {e}", code="invalid_body") from e
    except TimeoutError as e:
        raise APIError(408, f"request body not received within {st.cfg.server.body_read_timeout_s}s",
                       code="timeout") from e


async def read_request(request: web.Request,
                       decoder: msgspec.json.Decoder) -> tuple[GatewayState, TenantConfig, Any]:
    """Every generating endpoint's first steps, in this order: the tenant authenticated, the body read under the
    gateway's limits and decoded, its model named for the access log. -> (state, tenant, request struct)."""
    st = request.app[STATE]
    tenant = st.authenticate(request)
    req = decode(decoder, await read_body(request, st))
    context(request).model = req.model
    return st, tenant, req


def decode(decoder: msgspec.json.Decoder, body: bytes):
    try:
        return decoder.decode(body)
    except RecursionError:
        raise TooDeep(body) from None
    except msgspec.ValidationError as e:
        raise from_validation_error(e) from e
    except msgspec.DecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e


class TooDeep(APIError):
    """A body msgspec could not decode for its nesting. `named()` finds the field (gateway/nesting.py: numpy,
    which releases the GIL, so it runs in a thread and the loop keeps serving): the middleware answers that."""

    def __init__(self, body: bytes, limit: int = 64) -> None:
        super().__init__(400, "the request body nests too deeply to be parsed", code="nesting_too_deep")
        self.raw, self.limit = body, limit

    async def named(self) -> APIError:
        field = await asyncio.to_thread(deep_field, self.raw, self.limit)
        if field is None:
            return self
        return APIError(400, f"{field} nests more than {self.limit} levels deep: the request body cannot be parsed",
                        code="nesting_too_deep", param=field)


def check_nesting(limits: SchemaLimits, **fields) -> None:
    """400 naming the field when a free-form field (decoded as Any) nests deeper than limits.max_depth:
    what reads it later (templates, json.dumps, pickling to a worker) recurses once per level."""
    for name, value in fields.items():
        check_depth(value, name, limits)


def served_model(st: GatewayState, tenant: TenantConfig, name: str) -> ServedModel:
    model = st.models.get(name)
    if model is None or not tenant.allows(name):
        visible = sorted(m for m in st.models if tenant.allows(m))
        if model is None:
            raise APIError(404, f"unknown model {name!r}; serving: {', '.join(visible) or 'none'}",
                           code="model_not_found", param="model")
        raise APIError(403, f"model {name!r} is not enabled for this API key; allowed: {', '.join(visible) or 'none'}",
                       code="model_not_allowed", param="model")
    return model


def sampling_params(req, max_tokens: int, seed: int | None, logprobs: bool, top_logprobs: int,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = logit_bias_ids(req.logit_bias)
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature_of(req),
        top_p=top_p_of(req),
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        logprobs=logprobs, top_logprobs=top_logprobs, logit_bias=bias, prompt_logprobs=prompt_logprobs)
    try:
        sp.validate()
    except ValueError as e:
        raise bad_value(str(e).split("=", 1)[0], str(e)) from e
    return sp


class Job:
    """Everything decided before any backend is contacted."""

    def __init__(self, request: web.Request, st: GatewayState, tenant: TenantConfig, model: ServedModel,
                 kind: str) -> None:
        self.request, self.st, self.tenant, self.model, self.kind = request, st, tenant, model, kind
        self.rid: str = context(request).request_id            # echoed to the client, may be the client's own
        self.backend_id = os.urandom(16).hex()             # unique per request on every backend
        self.created = int(time.time())
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + self.backend_id
        self.headers: dict[str, str] = {}
        self.completion_tokens = 0                          # charged when the lease is given back
        self.tools: ToolPlan | None = None                  # chat with tools: output parsed into tool_calls
        self.echo: dict[int, str] = {}                      # completions with echo: choice index -> prompt text
        self.constraint_param: str | None = None            # the field a constraint came from (400s name it)

    def check_chars(self, chars: int, param: str) -> None:
        """The tenant's prompt size cap, checked before anything is tokenized."""
        cap = self.tenant.max_prompt_chars
        if cap and chars > cap:
            raise APIError(413, f"prompt has {chars} characters; this API key allows at most {cap} "
                                f"(max_prompt_chars)", code="prompt_too_large", param=param)

    def limits(self, prompts: list[Sequence[int]], requested: int | None) -> int:
        """Checks prompt sizes against the tenant and the nodes; returns max_tokens per choice."""
        st, tenant = self.st, self.tenant
        nodes = st.pool.for_model(self.model.name)
        if not nodes:
            raise APIError(503, f"no healthy backend for model {self.model.name!r}", code="backend_unavailable",
                           headers={"retry-after": "1"})
        max_len = min(n.info.max_model_len for n in nodes)  # type: ignore[union-attr]
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise bad_value("prompt", "the prompt is empty")
        if tenant.max_prompt_tokens and longest > tenant.max_prompt_tokens:
            raise APIError(400, f"prompt has {longest} tokens; this API key allows at most "
                                f"{tenant.max_prompt_tokens}", code="context_length_exceeded", param="messages")
        if longest >= max_len:
            raise APIError(400, f"prompt has {longest} tokens; the model's context is {max_len} tokens",
                           code="context_length_exceeded", param="messages")
        room = max_len - longest
        if requested is None:
            return min(st.cfg.server.default_max_tokens, room)
        if requested > room:
            raise APIError(400, f"prompt ({longest} tokens) + max_tokens ({requested}) exceeds the model's context "
                                f"of {max_len} tokens", code="context_length_exceeded", param="max_tokens")
        return requested

    def check_budget(self, prompt_tokens: int) -> None:
        tenant = self.tenant
        if tenant.tokens_per_min and prompt_tokens > tenant.tokens_per_min:
            raise APIError(400, f"request needs {prompt_tokens} prompt tokens; this API key's budget is "
                                f"{tenant.tokens_per_min} tokens/min", code="tokens_exceed_limit")

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Admission before any expensive work (tokenizing, routing); the lease is given back on leaving,
        whatever happens (error, cancellation), with `completion_tokens` charged."""
        lease = await self._admit()
        try:            # nothing between the admission and this try: the lease is always given back
            yield
        finally:
            st, tenant = self.st, self.tenant
            if not st.admission.finish_now(tenant, lease, self.completion_tokens):
                st.spawn(st.admission.finish(tenant, lease, self.completion_tokens))

    async def _admit(self) -> Lease:
        """The request rate limit, the tokens budget not in debt and one of the tenant's
        max_concurrent_streams (across every gateway sharing Redis), decided together; 429 if any refuses.
        The prompt's tokens are charged once counted (`charge_prompt`)."""
        st, tenant = self.st, self.tenant
        with obs.span("gateway.admission", {"edgeinfer.tenant": tenant.id}) as sp:
            decision, lease = await st.admission.admit(tenant, 0)
            sp.set_attributes({"edgeinfer.allowed": decision.allowed and lease is not None,
                               "edgeinfer.limited_by": decision.limited_by or ("concurrency" if lease is None else "")})
        self.headers.update(decision.headers(tenant))
        if not decision.allowed:
            st.metrics.rate_limited.labels(tenant.id, decision.limited_by).inc()
            raise APIError(429, f"rate limit exceeded ({decision.limited_by} per minute); retry after "
                                f"{decision.retry_after_s:.2f}s", code="rate_limit_exceeded", headers=self.headers)
        if lease is None:
            st.metrics.rate_limited.labels(tenant.id, "concurrency").inc()
            raise APIError(429, f"too many concurrent requests: this API key allows "
                                f"{tenant.max_concurrent_streams}", code="concurrency_limit_exceeded",
                           headers={**self.headers, "retry-after": "1"})
        return lease

    async def charge_prompt(self, prompt_tokens: int) -> None:
        st, tenant = self.st, self.tenant
        decision = await st.admission.charge_prompt(tenant, prompt_tokens)
        self.headers.update((k, v) for k, v in decision.headers(tenant).items() if "-tokens" in k or k == "retry-after")
        if not decision.allowed:
            st.metrics.rate_limited.labels(tenant.id, "tokens").inc()
            raise APIError(429, f"rate limit exceeded (tokens per minute: the prompt has {prompt_tokens}); retry "
                                f"after {decision.retry_after_s:.2f}s", code="rate_limit_exceeded",
                           headers=self.headers)

    def runs(self, prompts: list[Sequence[int]], n: int, make_sampling,
             constraint: Constraint | None = None) -> list[Run]:
        lists = [ids if isinstance(ids, list) else ids.tolist() for ids in prompts]  # type: ignore[attr-defined]
        return [Run(p * n + i, ids, make_sampling(i), f"{self.backend_id}-{p * n + i}", constraint=constraint,
                    constraint_param=self.constraint_param if constraint is not None else None)
                for p, ids in enumerate(lists) for i in range(n)]


def output_view(run: Run, chunk: StreamChunk) -> StreamChunk:
    """The chunk as the client sees it: a run that asked max_tokens 0 (echo: the prompt's logprobs only) ran one
    token on the node, which is dropped here."""
    if not run.discard_output or not (chunk.token_ids or chunk.text or chunk.logprobs):
        return chunk
    return msgspec.structs.replace(chunk, token_ids=[], text="", logprobs=None)


class Tally:
    """Per-request token accounting, fed by the final chunk of each run."""

    def __init__(self, n: int, on_clamp: Callable[[str], None] | None = None) -> None:
        self.n = n
        self.prompt = 0
        self.completion = 0
        self.cached = 0
        self.on_clamp = on_clamp     # told the field of each usage claim a node made that the gateway corrected

    def add(self, run: Run, chunk: StreamChunk) -> None:
        u = chunk.usage
        if u is None:
            return
        u = checked_usage(run, u, self.on_clamp)
        self.completion += 0 if run.discard_output else u.completion_tokens
        if run.index % self.n == 0:  # prompt counted once per prompt, as OpenAI does
            self.prompt += u.prompt_tokens
            h = run.handoff     # disaggregated: the decode node's hits include the pages handed to it
            # both held to the prompt already: checked_usage, and prefill_hop for a handed-off prompt
            self.cached += h.cached_tokens if h is not None and h.source is not None else u.cached_tokens

    def usage(self) -> UsageInfo:
        return UsageInfo(self.prompt, self.completion, self.prompt + self.completion,
                         PromptTokensDetails(self.cached))


async def execute(job: Job, runs: list[Run], n: int, stream: bool, include_usage: bool,
                  session: str, render=None) -> web.StreamResponse:
    """Route, run and answer; `render(job, runs, tally)` writes a response of another shape (gateway/
    serving_responses.py) instead of a chat completion or completion."""
    st, request = job.st, job.request
    tenant, model = job.tenant, job.model
    target = Target(model.name, tenant.namespace, session, tenant.spec())
    tally = Tally(n, st.metrics.usage_clamp(model.name))
    finished = False
    ctx = context(request)
    t0 = ctx.t0
    try:
        async with runs_open(st, target, runs):
            ctx.node = ",".join(sorted({r.node.node_id for r in runs if r.node}))
            ctx.route = runs[0].choice.decision if runs[0].choice else ""
            if render is not None:
                resp = await render(job, runs, tally)
            elif stream:
                resp = await _stream(job, runs, tally, include_usage, t0)
            else:
                resp = await _collect(job, runs, tally, t0)
            finished = True
            if st.fill_index and tenant.retain:     # a no-retain tenant's prompts never reach the index
                for r in runs:
                    if r.choice is not None and r.choice.hashes:
                        await st.index.publish(model.name, r.choice.node.node_id, r.choice.hashes)
                        if r.handoff is not None and r.handoff.source is not None:   # the prefill node holds them too
                            await st.index.publish(model.name, r.handoff.source.node_id, r.choice.hashes)
            return resp
    finally:
        usage = tally.usage()
        ctx.usage = usage
        series = st.metrics.series(tenant.id, model.name)
        series.prompt_tokens.inc(usage.prompt_tokens)
        series.completion_tokens.inc(usage.completion_tokens)
        series.cached_tokens.inc(usage.prompt_tokens_details.cached_tokens)
        if not finished and any(r.stream is not None and not r.stream.finished for r in runs):
            series.aborts.inc()
        job.completion_tokens = usage.completion_tokens


def _error_event(message: str, code: str, param: str | None = None) -> bytes:
    err = APIError(502, message, code=code, param=param)
    return b"data: " + encode(err.body()) + b"\n\n"


def chunk_error(run: Run, chunk: StreamChunk) -> APIError:
    """What a backend's error chunk means to the client: 400 naming the constraint's field when the
    request's own grammar failed (error_code 422), else 502."""
    reason = chunk.error or chunk.finish_reason
    code = error_code_name(chunk.error_code)
    if code == "backend_error":
        return APIError(502, f"generation failed on the backend: {reason}", code=code)
    return APIError(400, str(reason), code=code, param=run.constraint_param if code == GRAMMAR_FAILED else None)


async def _stream(job: Job, runs: list[Run], tally: Tally, include_usage: bool, t0: float) -> web.StreamResponse:
    st, model = job.st, job.model
    resp = web.StreamResponse(headers={**_SSE_HEADERS, **job.headers, "x-request-id": job.rid})
    await resp.prepare(job.request)
    ctx = context(job.request)
    ctx.stream = resp
    ctx.cut_event = lambda: _error_event(SHUTDOWN_MESSAGE, "shutting_down") + _DONE
    chat = job.kind == "chat"
    latency = _Latency(st.metrics.series(job.tenant.id, model.name), t0)
    started: set[int] = set()
    offsets = {r.index: 0 for r in runs}
    tool_streams = {r.index: ToolStream(job.tools.forced_names) for r in runs} if job.tools is not None else {}
    held: list[bytes] = []      # events not written yet: the next chunk is already buffered (one write for all)
    try:
        async for run, chunk, t in merged(runs):
            if chunk.token_ids:
                latency.observe(run.index, t)
            if chunk.error is not None or chunk.finish_reason in ("abort", "error"):
                err = chunk_error(run, chunk)
                held += (_error_event(err.message, err.code or "backend_error", err.param), _DONE)
                await resp.write(b"".join(held))
                return resp
            tally.add(run, chunk)
            chunk = output_view(run, chunk)
            if chunk.text or chunk.finish_reason is not None or chunk.logprobs or chunk.prompt_logprobs is not None:
                held.append(_event(job, run, chunk, chat, started, offsets, tool_streams))
            last = chunk.finish_reason is not None and len(runs) == 1     # written with the usage and [DONE]
            if held and not last and not more_ready(runs):
                await resp.write(b"".join(held))
                held.clear()
    except UpstreamBroken as e:
        held += (_error_event(f"backend stream failed: {e}", "upstream_failed"), _DONE)
        await resp.write(b"".join(held))
        return resp
    if include_usage:
        cls = ChatCompletionChunk if chat else Completion
        obj = "chat.completion.chunk" if chat else "text_completion"
        held.append(b"data: " + encode(cls(job.id, obj, job.created, model.name, [], tally.usage())) + b"\n\n")
    held.append(_DONE)
    await resp.write(b"".join(held))
    return resp


def _event(job: Job, run: Run, chunk: StreamChunk, chat: bool, started: set[int], offsets: dict[int, int],
           tool_streams: dict[int, ToolStream]) -> bytes:
    """One SSE event for a chunk carrying text, logprobs or the finish reason."""
    model = job.model
    out: ChatCompletionChunk | Completion
    if chat:
        role = None if run.index in started else "assistant"
        if tool_streams:
            content, calls, reason = tool_streams[run.index].step(chunk.text, chunk.finish_reason)
            delta = Delta(role=role, content=content, tool_calls=calls)
        else:
            delta, reason = Delta(role=role, content=chunk.text), chunk.finish_reason
        started.add(run.index)
        chat_lp = model.chat_logprobs(chunk.logprobs) if chunk.logprobs else None
        out = ChatCompletionChunk(job.id, "chat.completion.chunk", job.created, model.name,
                                  [ChatChunkChoice(run.index, delta, chat_lp, reason)])
    else:
        text = chunk.text
        if job.echo and run.index not in started:      # the first event of an echoed choice: the prompt first
            echo = job.echo[run.index]
            text = echo + text
            started.add(run.index)
            lp = model.echo_logprobs(run.prompt_ids, chunk.prompt_logprobs, chunk.logprobs or [], len(echo)) \
                if chunk.prompt_logprobs is not None else \
                model.completion_logprobs(chunk.logprobs, len(echo)) if chunk.logprobs else None
            offsets[run.index] = len(echo) + len(chunk.text)
        else:
            lp = model.completion_logprobs(chunk.logprobs, offsets[run.index]) if chunk.logprobs else None
            offsets[run.index] += len(chunk.text)
        out = Completion(job.id, "text_completion", job.created, model.name,
                         [CompletionChoice(run.index, text, lp, chunk.finish_reason)])
    return b"data: " + encode(out) + b"\n\n"


class _Latency:
    """TTFT (first token of any choice) and inter-token latency (per choice) of one request."""

    __slots__ = ("series", "t0", "last", "first_seen")
    last: dict[int, float]

    def __init__(self, series, t0: float) -> None:
        self.series, self.t0, self.last, self.first_seen = series, t0, {}, False

    def observe(self, index: int, t: float) -> None:
        if not self.first_seen:
            self.series.ttft.observe(t - self.t0)
            self.first_seen = True
        prev = self.last.get(index)
        if prev is not None:
            self.series.itl.observe(t - prev)
        self.last[index] = t


async def _collect(job: Job, runs: list[Run], tally: Tally, t0: float) -> web.Response:
    st, model = job.st, job.model
    texts: dict[int, list[str]] = {r.index: [] for r in runs}
    lps: dict[int, list] = {r.index: [] for r in runs}
    prompt_lps: dict[int, list] = {}
    reasons: dict[int, str | None] = {}
    latency = _Latency(st.metrics.series(job.tenant.id, model.name), t0)
    try:
        async for run, chunk, t in merged(runs):
            if chunk.token_ids:
                latency.observe(run.index, t)
            if chunk.error is not None or chunk.finish_reason in ("abort", "error"):
                raise chunk_error(run, chunk)
            tally.add(run, chunk)
            chunk = output_view(run, chunk)
            texts[run.index].append(chunk.text)
            if chunk.logprobs:
                lps[run.index].extend(chunk.logprobs)
            if chunk.prompt_logprobs is not None:
                prompt_lps[run.index] = chunk.prompt_logprobs
            if chunk.finish_reason is not None:
                reasons[run.index] = chunk.finish_reason
    except UpstreamBroken as e:
        raise APIError(502, f"backend stream failed after it started: {e}", code="upstream_failed") from e
    want_lp = runs[0].sampling.logprobs
    if job.kind == "chat":
        chat_choices = []
        for i in texts:
            message, reason = _message("".join(texts[i]), reasons.get(i), job.tools)
            chat_choices.append(ChatChoice(i, message, model.chat_logprobs(lps[i]) if want_lp else None, reason))
        body = encode(ChatCompletion(job.id, job.created, model.name, chat_choices, tally.usage()))
    else:
        by_index = {r.index: r for r in runs}

        def logprobs(i: int):
            if not want_lp:
                return None
            if i in prompt_lps:        # echo + logprobs: the prompt's tokens first (the first one's logprob null)
                return model.echo_logprobs(by_index[i].prompt_ids, prompt_lps[i], lps[i], len(job.echo.get(i, "")))
            return model.completion_logprobs(lps[i], len(job.echo.get(i, "")))

        choices = [CompletionChoice(i, job.echo.get(i, "") + "".join(texts[i]), logprobs(i), reasons.get(i))
                   for i in texts]
        body = encode(Completion(job.id, "text_completion", job.created, model.name, choices, tally.usage()))
    return web.Response(body=body, content_type="application/json",
                        headers={**job.headers, "x-request-id": job.rid})


def _message(text: str, reason: str | None, tools: ToolPlan | None) -> tuple[AssistantMessage, str | None]:
    """The assistant message and finish_reason of one choice ("tool_calls" when it called tools)."""
    if tools is None:
        return AssistantMessage("assistant", text), reason
    content, calls = split_output(text, reason, tools.forced_names)
    if not calls:
        return AssistantMessage("assistant", content or ""), reason
    return AssistantMessage("assistant", content, calls), "tool_calls" if reason == "stop" else reason


def constraint_field(req, tools: ToolPlan | None) -> str | None:
    """The request field a constraint comes from, named in a 400 if its grammar fails on the backend."""
    if tools is not None and tools.mode != "auto":
        return "tool_choice"
    for name in ("response_format", "guided_json", "guided_choice", "guided_regex"):
        value = getattr(req, name, None)
        if value is not None and (name != "response_format" or value.get("type") != "text"):
            return name
    return None


def check_bias_ids(model: ServedModel, bias: dict[str, float] | None) -> None:
    vocab = model.tokenizer.vocab_size
    for t in logit_bias_ids(bias):
        if t >= vocab:
            raise bad_value("logit_bias", f"logit_bias token id {t} is out of range [0, {vocab})")


def session_key(request: web.Request, prompt_cache_key: str | None = None) -> str:
    """The routing affinity key: the x-session-affinity header, else OpenAI's prompt_cache_key (the same
    meaning: requests that share it go to the node that holds their prefix)."""
    session = request.headers.get("x-session-affinity", "") or (prompt_cache_key or "")
    session = session[:256]
    try:
        session.encode()
    except UnicodeEncodeError as e:   # aiohttp keeps non-UTF-8 header bytes as lone surrogates
        raise APIError(400, "x-session-affinity header is not UTF-8 text", code="invalid_header",
                       param="x-session-affinity") from e
    return session


def new_request_id(header: str | None) -> str:
    if header and len(header) <= 128 and header.replace("-", "").replace("_", "").isalnum():
        return header
    return os.urandom(16).hex()
