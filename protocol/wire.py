"""Wire format of the backend's internal API (gateway <-> backend). Torch-free.

POST /internal/generate   body: GenerateRequest (JSON)  -> 200, application/x-ndjson,
                          one StreamChunk per line; the last chunk has finish_reason set
                          (or error set) and usage.
POST /internal/abort      body: AbortRequest            -> 200 {"aborted": bool}
POST /internal/kv/pages   body: KVPagesRequest          -> 200, application/octet-stream: the sealed pages this
                          node holds of the requested chain, in order, up to the first it does not hold; each
                          framed as a 4-byte little-endian length + the page's codec blob (cache_store.codec)
GET  /internal/info       -> BackendInfo
GET  /health              -> 200 when the process is up
GET  /ready               -> 200 when it accepts new requests (503 while draining/loading)
GET  /metrics             -> Prometheus text
POST /admin/drain, /admin/undrain  (header `authorization: Bearer <operator key>`)

Closing the HTTP connection of a generate stream aborts the request.
"""

from __future__ import annotations

import math

import msgspec


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    max_tokens: int = 16
    temperature: float = 1.0          # below 1e-5 (sampler.GREEDY_BELOW) -> greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 -> disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] = {}   # token id -> added to its logit before the grammar mask, in [-100, 100]
    # the prompt's own logprobs (completions' echo + logprobs; vLLM's prompt_logprobs): None off, else each prompt
    # token's logprob given the tokens before it and this many top alternatives; the first token has none
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the bad field and what was expected."""
        def bad(name: str, value: object, expected: str) -> None:
            raise ValueError(f"{name}={value!r} is invalid: expected {expected}")

        if self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v):
                bad(name, v, "a finite number")
        if self.temperature < 0:
            bad("temperature", self.temperature, "a number >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "a number in (0, 1]")
        if self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 disables)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "a number in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "a number > 0")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        if not 0 <= self.top_logprobs <= 20:
            bad("top_logprobs", self.top_logprobs, "an integer in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", self.prompt_logprobs, "null or an integer in [0, 20]")
        if len(self.stop) > 16:
            bad("stop", f"{len(self.stop)} strings", "at most 16 stop strings")
        for tok, bias in self.logit_bias.items():
            if tok < 0 or not math.isfinite(bias) or not -100 <= bias <= 100:
                bad("logit_bias", {tok: bias}, "token ids >= 0 with biases in [-100, 100]")


class TenantSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who a request is for, from the gateway's tenant config (backend.engine.fair uses it)."""
    id: str
    weight: float = 1.0               # share of served tokens and of the prefix cache, relative to other tenants
    priority: int = 0                 # class: 0 is served first, larger numbers wait (with aging)
    retain: bool = True               # False: its KV pages are never cached, published or indexed
    max_running_pages: int = 0        # hard cap on KV pages its running requests hold (0: none)

    def validate(self) -> None:
        if not self.id:
            raise ValueError("tenant.id is empty: expected the tenant's id")
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise ValueError(f"tenant.weight={self.weight!r} is invalid: expected a finite number > 0")
        if not 0 <= self.priority <= 9:
            raise ValueError(f"tenant.priority={self.priority!r} is invalid: expected an integer in [0, 9]")
        if self.max_running_pages < 0:
            raise ValueError(f"tenant.max_running_pages={self.max_running_pages!r} is invalid: expected >= 0 "
                             "(0: no cap)")
class Constraint(msgspec.Struct, forbid_unknown_fields=True):
    """Grammar the output must match (backend/engine/grammar.py): kind "json_schema" (spec: the schema as
    JSON text, its properties in the schema's order), "lark" (spec: a Lark grammar, llguidance's dialect) or
    "regex" (spec: a regular expression the whole output matches)."""
    kind: str
    spec: str


class KVSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The prefill node that computed a request's prompt KV (prefill/decode disaggregation): the decode node pulls
    the prompt's pages from it over /internal/kv/pages before it schedules the request."""
    node_id: str
    url: str


ROLES = ("prefill", "decode", "both")    # a backend's --role


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_namespace: str
    model: str = ""
    tenant: TenantSpec | None = None   # None: the namespace is the tenant, weight 1, priority 0, retained
    constraint: Constraint | None = None
    # prefill/decode disaggregation (docs/DISAGGREGATION.md): the first hop computes the prompt's KV and answers one
    # chunk, finish_reason "prefilled", usage (cached_tokens: the prefill side's hits) and no token; the second hop
    # names the node that holds the KV
    prefill_only: bool = False
    kv_source: KVSource | None = None


class KVPagesRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Pages of one chain by hash, in chain order (the decode node computed them with the tenant's namespace)."""
    hashes: list[bytes]


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class StreamChunk(msgspec.Struct, omit_defaults=True):
    request_id: str
    token_ids: list[int] = []
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), in the request's first chunk
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | "prefilled" (prefill_only)
    usage: Usage | None = None
    error: str | None = None
    error_code: int | None = None      # HTTP-like status of an error: 4xx the request is invalid, 500 this
    #                                    request failed on a healthy node (others were unaffected): neither is
    #                                    retried elsewhere; 503 the node cannot serve (draining, engine failed)


class AbortRequest(msgspec.Struct):
    request_id: str


class BackendInfo(msgspec.Struct):
    node_id: str
    model: str
    model_fingerprint: str
    kv_format: str
    page_size: int
    max_model_len: int
    version: str
    state: str                         # "active" | "draining"
    role: str = "both"                 # "prefill" | "decode" | "both" (ROLES)
    kv_gate: dict | None = None        # how kv_format was chosen, with its measured costs (backend/quant/kv_gate.py)


encode = msgspec.json.encode
chunk_decoder = msgspec.json.Decoder(StreamChunk)
request_decoder = msgspec.json.Decoder(GenerateRequest)
info_decoder = msgspec.json.Decoder(BackendInfo)
pages_request_decoder = msgspec.json.Decoder(KVPagesRequest)
