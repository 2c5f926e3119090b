"""OpenAI-compatible wire schema (requests and responses), validated with msgspec at the HTTP boundary.

Rule: a body that is not JSON -> 400; an unknown field -> 400 naming it (OpenAI's answer); a wrong type or a
missing field -> 400 naming it (msgspec, as OpenAI answers); a value out of range or an unsupported feature ->
400 (checked in check_*).

Fields today's SDKs send that change nothing here are accepted with a documented meaning (docs/GATEWAY.md):
`prompt_cache_key` is the routing affinity key (as the x-session-affinity header); `safety_identifier`, `user`,
`verbosity`, `metadata` and `modalities: ["text"]` are accepted; `reasoning_effort` is accepted and ignored
(the served models do not reason); `stream_options.include_obfuscation` is accepted (no obfuscation padding
is sent). vLLM's extras: `chat_template_kwargs`, `guided_json` / `guided_choice` / `guided_regex` (onto the
same grammar path as response_format).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from edgeinfer.gateway.errors import bad_value
from edgeinfer.gateway.tools import ToolCall, ToolCallDelta

Role = Literal["system", "user", "assistant", "tool", "developer"]


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant turn that called tools (gateway/tools.py)
    tool_call_id: str | None = None                    # a tool turn: the result of that call


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None    # accepted: no obfuscation padding is added to the events


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> bias in [-100, 100]
    # accepted for client compatibility (see the module docstring)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's guided decoding (one at most; not with response_format)
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[str] | None = None
    guided_regex: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str | int | list[int]]   # text, texts, token ids or lists of token ids
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None


MAX_LOGIT_BIAS = 1024    # entries; OpenAI documents the range of a value, not a count


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias ({"<token id>": bias in [-100, 100]}) as ids; 400 naming the bad entry."""
    out: dict[int, float] = {}
    if not bias:
        return out
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_value("logit_bias", f"logit_bias has {len(bias)} entries: at most {MAX_LOGIT_BIAS}")
    for key, value in bias.items():
        if not key.isdigit():
            raise bad_value("logit_bias", f"logit_bias key {key!r} is invalid: expected a token id (a decimal "
                                          "integer as a string)")
        if not -100 <= value <= 100:
            raise bad_value("logit_bias", f"logit_bias[{key!r}]={value!r} is invalid: expected a number in "
                                          "[-100, 100]")
        out[int(key)] = float(value)
    return out


DEFAULT_TEMPERATURE = 1.0     # OpenAI's defaults, echoed back where a response names them
DEFAULT_TOP_P = 1.0


def check_sampling_fields(req) -> None:
    """The sampling fields every endpoint shares (chat, completions, responses), checked in one place; the rest
    of their ranges are SamplingParams.validate's (protocol/wire.py) when the gateway builds the request."""
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise bad_value("temperature", f"temperature={req.temperature!r} is invalid: expected a number in [0, 2]")


def temperature_of(req) -> float:
    return DEFAULT_TEMPERATURE if req.temperature is None else req.temperature


def top_p_of(req) -> float:
    return DEFAULT_TOP_P if req.top_p is None else req.top_p


def check_common(req: _Sampling, max_n: int) -> None:
    if not 1 <= req.n <= max_n:
        raise bad_value("n", f"n={req.n} is invalid: expected an integer in [1, {max_n}]")
    if req.stream_options is not None and not req.stream:
        raise bad_value("stream_options", "stream_options is only allowed when stream=true")
    check_sampling_fields(req)
    logit_bias_ids(req.logit_bias)
    guided = [name for name in ("guided_json", "guided_choice", "guided_regex") if getattr(req, name) is not None]
    if len(guided) > 1:
        raise bad_value(guided[1], f"{guided[0]} and {guided[1]} cannot be combined: give one guided_* field")
    if guided and getattr(req, "response_format", None) is not None:
        raise bad_value(guided[0], f"{guided[0]} cannot be combined with response_format")
    if req.guided_choice is not None and not req.guided_choice:
        raise bad_value("guided_choice", "guided_choice must list at least one string")
    if req.max_tokens is not None and req.max_tokens < (0 if getattr(req, "echo", False) else 1):
        raise bad_value("max_tokens", f"max_tokens={req.max_tokens} is invalid: expected an integer >= 1 (0 only "
                                      "with echo on /v1/completions: the prompt's logprobs, no new token)")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def check_chat(req: ChatCompletionRequest, max_n: int) -> None:
    check_common(req, max_n)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_value("top_logprobs", "top_logprobs requires logprobs=true")
        if not 0 <= req.top_logprobs <= 20:
            raise bad_value("top_logprobs", f"top_logprobs={req.top_logprobs} is invalid: expected [0, 20]")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise bad_value("max_completion_tokens",
                        f"max_completion_tokens={req.max_completion_tokens} is invalid: expected an integer >= 1")
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise bad_value("reasoning_effort", f"reasoning_effort={req.reasoning_effort!r} is invalid: expected one "
                                            f"of {', '.join(REASONING_EFFORTS)}")
    if req.verbosity is not None and req.verbosity not in ("low", "medium", "high"):
        raise bad_value("verbosity", f"verbosity={req.verbosity!r} is invalid: expected low, medium or high")
    if req.modalities is not None and req.modalities != ["text"]:
        raise bad_value("modalities", f"modalities={req.modalities!r} is not supported: this server answers "
                                      "text only (['text'])", code="unsupported_parameter")
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_value(f"messages[{i}].content[{j}]",
                                    f"content part type {part.type!r} is not supported; only 'text' parts",
                                    code="unsupported_parameter")


def check_completion(req: CompletionRequest, max_n: int) -> None:
    check_common(req, max_n)
    if req.suffix:
        raise bad_value("suffix", "suffix is not supported", code="unsupported_parameter")
    if req.best_of not in (None, req.n):
        raise bad_value("best_of", "best_of must equal n (server-side best-of is not supported)",
                        code="unsupported_parameter")
    if req.logprobs is not None and not 0 <= req.logprobs <= 5:
        raise bad_value("logprobs", f"logprobs={req.logprobs} is invalid: expected an integer in [0, 5]")
    if isinstance(req.prompt, list):
        if not req.prompt:
            raise bad_value("prompt", "prompt must not be an empty list")
        kinds = {type(p) for p in req.prompt}
        if len(kinds) != 1:
            raise bad_value("prompt", "prompt must be a string, a list of strings, a list of token ids "
                                      "or a list of lists of token ids (not a mix)")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        out.append(d)
    return out


# ---- responses ---------------------------------------------------------------------------------

class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]            # None: the first prompt token of an echo (no context)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str                       # "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None    # present only with stream_options.include_usage


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, omit_defaults=True):
    id: str
    object: str                       # "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "edgeinfer"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_decoder = msgspec.json.Decoder(CompletionRequest)
encode = msgspec.json.Encoder().encode
