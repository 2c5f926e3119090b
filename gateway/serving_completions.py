"""POST /v1/completions: text or token-id prompts (several per request), echo, then the shared pipeline
(gateway/pipeline.py)."""

from __future__ import annotations

from collections.abc import Sequence

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
    check_completion,
    completion_decoder,
)
from edgeinfer.gateway.structured import Pending, constraint_for, guided_constraint
from edgeinfer.protocol.wire import SamplingParams


async def completions(request: web.Request) -> web.StreamResponse:
    st, tenant, req = await read_request(request, completion_decoder)
    check_completion(req, st.cfg.server.max_n)
    model = served_model(st, tenant, req.model)
    check_bias_ids(model, req.logit_bias)
    limits, pending = st.schema_limits, Pending()
    constraint = constraint_for(req.response_format, limits, pending) or guided_constraint(
        req.guided_json, req.guided_choice, req.guided_regex, limits, pending)
    check_nesting(limits, response_format=req.response_format, guided_json=req.guided_json)
    p = req.prompt
    texts = [p] if isinstance(p, str) else list(p) if p and isinstance(p[0], str) else []
    count = len(texts) if texts else (1 if p and isinstance(p[0], int) else len(p))
    if count * req.n > st.cfg.server.max_n:
        raise bad_value("n", f"{count} prompts x n={req.n} = {count * req.n} choices exceeds the "
                             f"limit of {st.cfg.server.max_n}")
    job = Job(request, st, tenant, model, "completion")
    job.constraint_param = constraint_field(req, None)
    job.check_chars(sum(len(t) for t in texts), "prompt")  # type: ignore[arg-type]
    session = session_key(request, req.prompt_cache_key)
    top = req.logprobs or 0
    sampling_params(req, 1, req.seed, req.logprobs is not None, top)   # a bad sampling value: 400 before admission
    async with job.admitted():
        await st.schemas.check(pending)
        prompts: list[Sequence[int]]
        if texts:
            prompts = [await model.encode_prompt(t) for t in texts]  # type: ignore[arg-type]
        elif isinstance(p[0], int):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        if not texts:
            for ids in prompts:
                model.check_ids(ids)  # type: ignore[arg-type]
        echo_only = req.echo and req.max_tokens == 0      # the prompt's logprobs, no token: one is run, dropped
        max_tokens = job.limits(prompts, 16 if req.max_tokens is None else max(req.max_tokens, 1))
        prompt_tokens = sum(len(x) for x in prompts)
        job.check_budget(prompt_tokens)
        await job.charge_prompt(prompt_tokens)

        prompt_lps = top if req.echo and req.logprobs is not None else None

        def make(i: int) -> SamplingParams:
            return sampling_params(req, max_tokens, None if req.seed is None else req.seed + i,
                                   req.logprobs is not None, top, prompt_lps)

        runs = job.runs(prompts, req.n, make, constraint)
        for r in runs:
            r.discard_output = echo_only
        if req.echo:   # each choice starts with its prompt, as text (token-id prompts decoded)
            job.echo = {r.index: (texts[r.index // req.n] if texts else model.tokenizer.decode(r.prompt_ids, False))
                        for r in runs}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await execute(job, runs, req.n, req.stream, include_usage, session)
