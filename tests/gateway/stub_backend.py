"""A stand-in for backend.server in gateway unit tests: speaks protocol/wire.py over real HTTP.

It "generates" a fixed phrase one byte-token at a time, honours max_tokens, stop strings and
logprobs, reports cached_tokens as the page-aligned common prefix with earlier prompts of the same
namespace (like a prefix cache would), records every request and abort, and can be told to fail.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

from edgeinfer.protocol.wire import (
    AbortRequest,
    BackendInfo,
    StreamChunk,
    TokenLogprob,
    Usage,
    encode,
    request_decoder,
)

PHRASE = "The quick brown fox jumps over the lazy dog. "


@dataclass
class StubBehaviour:
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0    # after the response head, before the first chunk (queueing + prefill)
    keepalive_every_s: float = 0.0      # during first_token_delay_s: an empty line this often (a working queue)
    overloaded_retry_after: int = 0     # answer 503 + Retry-After like backend.server's queue bound
    fail_status: int = 0                 # answer /internal/generate with this HTTP status
    drop_before_first: bool = False      # close the connection before any chunk
    fail_after_tokens: int = -1          # close the connection after this many tokens
    error_chunk: tuple[int, str] | None = None  # first chunk is an error (code, message)
    burst: bool = False                  # every chunk in one write at the end (a relay that fell behind)
    ready: bool = True
    phrase: str = PHRASE
    usage_claim: tuple[int, int, int] | None = None   # (prompt, completion, cached) claimed instead of the truth
    endless_line_bytes: int = 0          # first write this many bytes with no newline (1 MiB writes), then stop


@dataclass
class StubBackend:
    node_id: str
    tokenizer: object
    model: str = "stub-model"
    page_size: int = 4
    max_model_len: int = 2048
    behaviour: StubBehaviour = field(default_factory=StubBehaviour)
    requests: list = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    secret: str = ""                     # when set, /internal/* wants `authorization: Bearer <secret>` (else 401)
    auth_seen: list[tuple[str, str | None]] = field(default_factory=list)   # (path, authorization) per call
    history: dict[str, list[list[int]]] = field(default_factory=dict)
    sent_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cached_tokens(self, namespace: str, ids: list[int]) -> int:
        best = 0
        for old in self.history.get(namespace, []):
            n = 0
            for a, b in zip(old, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1) // self.page_size * self.page_size

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = request_decoder.decode(await request.read())
        b = self.behaviour
        with self.lock:
            self.requests.append(req)
        if b.fail_status:
            return web.Response(status=b.fail_status, text="stub failure")
        if b.overloaded_retry_after:
            return web.json_response({"error": {"message": "stub overloaded", "code": 503, "type": "overloaded"}},
                                     status=503, headers={"retry-after": str(b.overloaded_retry_after)})
        resp = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await resp.prepare(request)
        if b.drop_before_first:
            request.transport.close()
            return resp
        if b.endless_line_bytes:
            chunk = b"x" * (1 << 20)
            try:
                for _ in range(b.endless_line_bytes >> 20):
                    await resp.write(chunk)
                    with self.lock:
                        self.sent_bytes += len(chunk)
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnects.append(req.request_id)
            return resp
        if b.error_chunk:
            code, msg = b.error_chunk
            await resp.write(encode(StreamChunk(req.request_id, finish_reason="error", error=msg,
                                                error_code=code)) + b"\n")
            return resp
        sp = req.sampling
        cached = self.cached_tokens(req.cache_namespace, req.prompt_token_ids)
        text_so_far = ""
        produced = 0
        held: list[bytes] = []
        finish = "length"
        try:
            if b.first_token_delay_s:
                end = time.monotonic() + b.first_token_delay_s
                while (left := end - time.monotonic()) > 0:
                    await asyncio.sleep(min(left, b.keepalive_every_s or left))
                    if b.keepalive_every_s and time.monotonic() < end:
                        await resp.write(b"\n")
            for i in range(sp.max_tokens):
                ch = b.phrase[i % len(b.phrase)]
                if i and i % len(b.phrase) == 0 and not sp.ignore_eos:
                    finish = "stop"
                    break
                if 0 <= b.fail_after_tokens <= i:
                    request.transport.close()
                    return resp
                text_so_far += ch
                hit = next((s for s in sp.stop if s in text_so_far), None)
                if hit:
                    finish = "stop"
                    break
                tid = self.tokenizer.encode(ch)[0]
                lps = None
                if sp.logprobs:
                    top = [(tid, -0.25), (self.tokenizer.encode("x")[0], -1.5)][:sp.top_logprobs]
                    lps = [TokenLogprob(tid, -0.25, top)]
                if b.token_delay_s:
                    await asyncio.sleep(b.token_delay_s)
                line = encode(StreamChunk(req.request_id, [tid], ch, lps)) + b"\n"
                if b.burst:
                    held.append(line)
                else:
                    await resp.write(line)
                produced += 1
            with self.lock:
                self.history.setdefault(req.cache_namespace, []).append(list(req.prompt_token_ids))
            usage = Usage(*b.usage_claim) if b.usage_claim else Usage(len(req.prompt_token_ids), produced, cached)
            await resp.write(b"".join(held) + encode(StreamChunk(req.request_id, finish_reason=finish, usage=usage))
                             + b"\n")
            self.completed.append(req.request_id)
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects.append(req.request_id)
            raise
        return resp

    async def abort(self, request: web.Request) -> web.Response:
        import msgspec

        req = msgspec.json.decode(await request.read(), type=AbortRequest)
        self.aborts.append(req.request_id)
        return web.json_response({"aborted": True})

    async def info(self, request: web.Request) -> web.Response:
        info = BackendInfo(self.node_id, self.model, "stub-fp-1", "fp16", self.page_size, self.max_model_len,
                           "stub-1", "active")
        return web.Response(body=encode(info), content_type="application/json")

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.behaviour.ready else 503)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    @web.middleware
    async def check_secret(self, request: web.Request, handler):
        if request.path.startswith("/internal/"):
            got = request.headers.get("authorization")
            self.auth_seen.append((request.path, got))
            if self.secret and got != f"Bearer {self.secret}":
                return web.json_response({"error": {"message": "internal secret", "code": 401}}, status=401)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.check_secret])
        app.router.add_post("/internal/generate", self.generate)
        app.router.add_post("/internal/abort", self.abort)
        app.router.add_get("/internal/info", self.info)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/health", self.health)
        return app


