"""POST /v1/chat/completions: messages through the chat template (tools rendered, a forced tool call or a
response_format as a grammar), then the shared pipeline (gateway/pipeline.py)."""

from __future__ import annotations

from aiohttp import web

from edgeinfer.gateway.errors import bad_value
from edgeinfer.gateway.pipeline import (
    Job,
    check_bias_ids,
    check_nesting,
    constraint_field,
    execute,
    read_request,
    sampling_params,
    served_model,
    session_key,
)
from edgeinfer.gateway.schemas import (
    chat_decoder,
    check_chat,
    message_dicts,
)
from edgeinfer.gateway.structured import Pending, constraint_for, guided_constraint
from edgeinfer.gateway.tools import plan_tools, render_messages
from edgeinfer.protocol.wire import SamplingParams


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st, tenant, req = await read_request(request, chat_decoder)
    check_chat(req, st.cfg.server.max_n)
    model = served_model(st, tenant, req.model)
    check_bias_ids(model, req.logit_bias)
    limits, pending = st.schema_limits, Pending()
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, limits, pending)
    constraint = constraint_for(req.response_format, limits, pending) or guided_constraint(
        req.guided_json, req.guided_choice, req.guided_regex, limits, pending)
    check_nesting(limits, tools=req.tools, tool_choice=req.tool_choice, response_format=req.response_format,
                  guided_json=req.guided_json, chat_template_kwargs=req.chat_template_kwargs,
                  messages=[m.tool_calls for m in req.messages if m.tool_calls])
    if tools is not None and tools.mode != "auto":
        if constraint is not None:
            raise bad_value("response_format", "response_format cannot be combined with a tool_choice that "
                                               "forces a tool call")
        constraint = tools.constraint()
    messages = render_messages(message_dicts(req.messages), tools)
    job = Job(request, st, tenant, model, "chat")
    job.tools = tools
    job.constraint_param = constraint_field(req, tools)
    job.check_chars(sum(len(m["content"]) for m in messages), "messages")
    session = session_key(request, req.prompt_cache_key)
    top = req.top_logprobs or 0
    sampling_params(req, 1, req.seed, req.logprobs, top)   # a bad sampling value: 400 before admission
    async with job.admitted():
        await st.schemas.check(pending)       # off the event loop, after admission (gateway/schema_guard.py)
        prompt = await model.encode_chat(messages, req.chat_template_kwargs)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = job.limits([prompt], requested)
        job.check_budget(len(prompt))
        await job.charge_prompt(len(prompt))

        def make(i: int) -> SamplingParams:
            return sampling_params(req, max_tokens, None if req.seed is None else req.seed + i, req.logprobs, top)

        runs = job.runs([prompt], req.n, make, constraint)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await execute(job, runs, req.n, req.stream, include_usage, session)
