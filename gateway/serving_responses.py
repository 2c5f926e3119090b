"""OpenAI's Responses API (`POST /v1/responses`) on the chat pipeline, and vLLM's `/tokenize`, `/detokenize`.

/v1/responses: `input` (a string, or message items with input_text parts and function_call /
function_call_output items), `instructions` (a system turn), `max_output_tokens`, `temperature`, `top_p`,
`tools` (function tools, Responses' flat form) with `tool_choice`, `text.format` (text / json_object /
json_schema: the same grammar path as response_format), `stream` with OpenAI's event names
(response.created ... response.output_text.delta ... response.completed). No state is kept:
`previous_response_id` is refused with a 400 (send the whole conversation as `input`), and `store` is
accepted and ignored (nothing is stored, so nothing can be retrieved).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
from aiohttp import web

from edgeinfer.gateway import pipeline
from edgeinfer.gateway.context import context
from edgeinfer.gateway.errors import APIError, bad_value
from edgeinfer.gateway.generation import merged
from edgeinfer.gateway.schemas import (
    REASONING_EFFORTS,
    check_sampling_fields,
    encode,
    temperature_of,
    top_p_of,
)
from edgeinfer.gateway.structured import Pending, constraint_for
from edgeinfer.gateway.tools import ToolStream, plan_tools, render_messages, split_output
from edgeinfer.gateway.upstream import UpstreamBroken


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    seed: int | None = None
    stream_options: dict[str, Any] | None = None


responses_decoder = msgspec.json.Decoder(ResponsesRequest)


class ChatShape(msgspec.Struct, kw_only=True):
    """The fields pipeline.sampling_params reads, from a Responses request."""
    model: str
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise bad_value(f"{where}[{j}]", f"content part type {kind!r} is not supported; only "
                                                 "input_text / output_text parts", code="unsupported_parameter")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad_value(where, "content must be a string or a list of input_text parts")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` + `input` as chat messages ({"role", "content", "tool_calls"?})."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    if not req.input:
        raise bad_value("input", "input must not be empty")
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_value(f"input[{i}].role", f"role {role!r} is invalid: expected user, assistant, system or "
                                                    "developer")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content", ""), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": str(item.get("output", ""))})
        else:
            raise bad_value(f"input[{i}].type", f"input item type {kind!r} is not supported: expected message, "
                                                "function_call or function_call_output", code="unsupported_parameter")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({"type": "function", "name", "parameters"}) in chat's nested form."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad_value(f"tools[{i}].type", f"tool type {t.get('type')!r} is not supported: only function "
                                                "tools", code="unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def check(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise bad_value("previous_response_id", "previous_response_id is not supported: this server keeps no "
                                                "responses; send the whole conversation as input",
                        code="unsupported_parameter")
    check_sampling_fields(req)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_value("max_output_tokens", f"max_output_tokens={req.max_output_tokens} is invalid: expected "
                                             "an integer >= 1")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_value("reasoning.effort", f"reasoning.effort={effort!r} is invalid: expected one of "
                                            f"{', '.join(REASONING_EFFORTS)}")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """Responses' text.format -> chat's response_format."""
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


class ResponseBuilder:
    """The Response object and its streamed events, for one choice."""

    def __init__(self, req: ResponsesRequest, model: str, tools_plan) -> None:
        self.req, self.model, self.tools = req, model, tools_plan
        self.id = "resp_" + os.urandom(12).hex()
        self.msg_id = "msg_" + os.urandom(12).hex()
        self.created = int(time.time())
        self.seq = 0

    def obj(self, status: str, output: list[dict], usage: dict | None, reason: str | None) -> dict:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "temperature": temperature_of(r), "top_p": top_p_of(r), "parallel_tool_calls": r.parallel_tool_calls is not False,
                "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "metadata": r.metadata or {},
                "text": r.text or {"format": {"type": "text"}}, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False, "truncation": "disabled"}

    def message(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def function_call(call) -> dict:
        return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                "name": call.function.name, "arguments": call.function.arguments, "status": "completed"}

    def output(self, text: str, reason: str | None) -> list[dict]:
        if self.tools is None:
            return [self.message(text)]
        content, calls = split_output(text, reason, self.tools.forced_names)
        out = [self.message(content)] if content else []
        return out + [self.function_call(c) for c in calls]

    @staticmethod
    def usage(tally) -> dict:
        u = tally.usage()
        return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                "total_tokens": u.total_tokens,
                "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode(body) + b"\n\n"


async def collect(job, runs, tally, builder: ResponseBuilder) -> web.Response:
    parts: list[str] = []
    reason = None
    try:
        async for run, chunk, _t in merged(runs):
            if chunk.error is not None or chunk.finish_reason in ("abort", "error"):
                raise pipeline.chunk_error(run, chunk)
            tally.add(run, chunk)
            parts.append(chunk.text)
            reason = chunk.finish_reason or reason
    except UpstreamBroken as e:
        raise APIError(502, f"backend stream failed after it started: {e}", code="upstream_failed") from e
    status = "incomplete" if reason == "length" else "completed"
    body = builder.obj(status, builder.output("".join(parts), reason), builder.usage(tally), reason)
    return web.Response(body=encode(body), content_type="application/json",
                        headers={**job.headers, "x-request-id": job.rid})


async def stream(job, runs, tally, builder: ResponseBuilder) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache",
                                       "x-accel-buffering": "no", **job.headers, "x-request-id": job.rid})
    await resp.prepare(job.request)
    b = builder
    ctx = context(job.request)
    ctx.stream = resp
    ctx.cut_event = lambda: b.event("error", code="shutting_down", message=pipeline.SHUTDOWN_MESSAGE, param=None)
    await resp.write(b.event("response.created", response=b.obj("in_progress", [], None, None))
                     + b.event("response.in_progress", response=b.obj("in_progress", [], None, None)))
    tool_stream = ToolStream(b.tools.forced_names) if b.tools is not None else None
    text, opened, calls, reason = "", False, [], None

    def open_message() -> bytes:
        return (b.event("response.output_item.added", output_index=0, item=b.message("", "in_progress"))
                + b.event("response.content_part.added", item_id=b.msg_id, output_index=0, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []}))
    try:
        async for run, chunk, _t in merged(runs):
            if chunk.error is not None or chunk.finish_reason in ("abort", "error"):
                err = pipeline.chunk_error(run, chunk)
                await resp.write(b.event("error", code=err.code, message=err.message, param=err.param))
                return resp
            tally.add(run, chunk)
            reason = chunk.finish_reason or reason
            if tool_stream is not None:
                delta, new_calls, _ = tool_stream.step(chunk.text, chunk.finish_reason)
                calls += [c for c in (new_calls or [])]
            else:
                delta = chunk.text
            if delta:
                out = b"" if opened else open_message()
                opened = True
                text += delta
                await resp.write(out + b.event("response.output_text.delta", item_id=b.msg_id, output_index=0,
                                               content_index=0, delta=delta, logprobs=[]))
    except UpstreamBroken as e:
        await resp.write(b.event("error", code="upstream_failed", message=f"backend stream failed: {e}", param=None))
        return resp
    events = []
    output: list[dict] = []
    if opened:
        events += [b.event("response.output_text.done", item_id=b.msg_id, output_index=0, content_index=0,
                           text=text, logprobs=[]),
                   b.event("response.content_part.done", item_id=b.msg_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": text, "annotations": []}),
                   b.event("response.output_item.done", output_index=0, item=b.message(text))]
        output.append(b.message(text))
    for c in calls:
        item = b.function_call(c)
        idx = len(output)
        events += [b.event("response.output_item.added", output_index=idx, item={**item, "status": "in_progress"}),
                   b.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                           arguments=item["arguments"]),
                   b.event("response.output_item.done", output_index=idx, item=item)]
        output.append(item)
    status = "incomplete" if reason == "length" else "completed"
    final = b.obj(status, output, b.usage(tally), reason)
    events.append(b.event("response.incomplete" if status == "incomplete" else "response.completed", response=final))
    await resp.write(b"".join(events))
    return resp


async def create_response(request: web.Request) -> web.StreamResponse:
    st, tenant, req = await pipeline.read_request(request, responses_decoder)
    check(req)
    model = pipeline.served_model(st, tenant, req.model)
    limits, pending = st.schema_limits, Pending()
    tools = plan_tools(chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls, limits,
                       pending)
    constraint = constraint_for(response_format(req.text), limits, pending)
    pipeline.check_nesting(limits, input=req.input, tools=req.tools, tool_choice=req.tool_choice, text=req.text,
                      reasoning=req.reasoning, stream_options=req.stream_options)
    if tools is not None and tools.mode != "auto":
        if constraint is not None:
            raise bad_value("text.format", "text.format cannot be combined with a tool_choice that forces a call")
        constraint = tools.constraint()
    messages = render_messages(input_messages(req), tools)
    job = pipeline.Job(request, st, tenant, model, "responses")
    job.tools = tools
    job.constraint_param = "tool_choice" if tools is not None and tools.mode != "auto" else \
        "text.format" if constraint is not None else None
    job.check_chars(sum(len(m["content"]) for m in messages), "input")
    session = pipeline.session_key(request, req.prompt_cache_key)
    shape = ChatShape(model=req.model, temperature=req.temperature, top_p=req.top_p)
    pipeline.sampling_params(shape, 1, req.seed, False, 0)
    builder = ResponseBuilder(req, model.name, tools)
    async with job.admitted():
        await st.schemas.check(pending)
        prompt = await model.encode_chat(messages)
        max_tokens = job.limits([prompt], req.max_output_tokens)
        job.check_budget(len(prompt))
        await job.charge_prompt(len(prompt))
        runs = job.runs([prompt], 1, lambda i: pipeline.sampling_params(shape, max_tokens, req.seed, False, 0), constraint)
        render = stream if req.stream else collect
        return await pipeline.execute(job, runs, 1, req.stream, False, session,
                                 render=lambda job, runs, tally: render(job, runs, tally, builder))


# ---- vLLM's /tokenize and /detokenize ---------------------------------------------------------
