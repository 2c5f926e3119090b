"""POST /tokenize and /detokenize (vLLM's extension endpoints): a prompt or chat through the served model's
tokenizer and template, and token ids back to text; authenticated and admitted like every endpoint."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from edgeinfer.gateway import pipeline
from edgeinfer.gateway.errors import bad_value, from_validation_error
from edgeinfer.gateway.schemas import ChatMessage, message_dicts
from edgeinfer.gateway.state import STATE


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str = ""          # "" (as vLLM allows): the one model this key may use
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str = ""
    tokens: list[int]


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


async def tokenize(request: web.Request) -> web.Response:
    st, tenant, req = await pipeline.read_request(request, _tokenize_decoder)
    model = pipeline.served_model(st, tenant, req.model or _only_model(st, tenant))
    if (req.prompt is None) == (req.messages is None):
        raise bad_value("prompt", "give exactly one of prompt (text) or messages (a chat)")
    pipeline.check_nesting(st.schema_limits, messages=req.messages, chat_template_kwargs=req.chat_template_kwargs)
    job = pipeline.Job(request, st, tenant, model, "tokenize")
    msgs: list[dict[str, Any]] = []
    if req.messages is not None:
        try:
            msgs = message_dicts(msgspec.convert(req.messages, list[ChatMessage]))
        except msgspec.ValidationError as e:
            raise from_validation_error(e) from e
        job.check_chars(sum(len(m["content"]) for m in msgs), "messages")
    else:
        assert req.prompt is not None
        job.check_chars(len(req.prompt), "prompt")
    async with job.admitted():     # the tenant's request rate and concurrency, as for chat (no tokens charged)
        if req.messages is not None:
            extra = dict(req.chat_template_kwargs or {})
            if not req.add_generation_prompt:
                extra["add_generation_prompt"] = False
            ids = list(await model.encode_chat(msgs, extra or None))
        else:
            assert req.prompt is not None
            ids = list(await model.encode_prompt(req.prompt)) if req.add_special_tokens else \
                list(await model.encode_text(req.prompt))
    return web.json_response({"count": len(ids), "max_model_len": _max_model_len(st, model.name), "tokens": ids},
                             headers=job.headers)


async def detokenize(request: web.Request) -> web.Response:
    st, tenant, req = await pipeline.read_request(request, _detokenize_decoder)
    model = pipeline.served_model(st, tenant, req.model or _only_model(st, tenant))
    model.check_ids(req.tokens)
    job = pipeline.Job(request, st, tenant, model, "detokenize")
    async with job.admitted():
        text = model.tokenizer.decode(req.tokens, False)
    job.check_chars(len(text), "tokens")
    return web.json_response({"prompt": text}, headers=job.headers)



def _max_model_len(st, name: str) -> int | None:
    """The context every healthy node of the model serves (the smallest), None while none is up."""
    return min((n.info.max_model_len for n in st.pool.for_model(name) if n.info), default=None)


def _only_model(st, tenant) -> str:
    visible = sorted(m for m in st.models if tenant.allows(m))
    if len(visible) != 1:
        raise bad_value("model", f"model is required: this key may use {', '.join(visible) or 'no model'}",
                        code="missing_required_parameter")
    return visible[0]


async def tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info[?model=M] (vLLM's): the served model's special tokens, context and chat template, what a
    client that tokenizes through the server needs (lm-evaluation-harness' tokenizer_backend=remote)."""
    st = request.app[STATE]
    tenant = st.authenticate(request)
    model = pipeline.served_model(st, tenant, request.query.get("model") or _only_model(st, tenant))
    tok = model.tokenizer
    pad = tok.config.get("pad_token")
    return web.json_response({"model": model.name, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                              "pad_token": pad if isinstance(pad, str) else None,
                              "model_max_length": _max_model_len(st, model.name),
                              "add_bos_token": tok.add_bos, "vocab_size": tok.vocab_size,
                              "chat_template": tok.chat_template})
