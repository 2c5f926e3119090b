"""LLMEngine: the engine's asyncio face (submit, stream, stream in batches, call on the engine thread, abort,
validate) over EngineCore's step loop on its own thread (backend/engine/core.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from edgeinfer.backend.engine.core import EngineCore
from edgeinfer.backend.engine.grammar import GrammarError
from edgeinfer.backend.engine.observer import EngineObserver
from edgeinfer.backend.engine.requests import RequestError, validate_request
from edgeinfer.backend.engine.sampler import GrammarFailed, make_generator
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.backend.engine.stop import StopChecker
from edgeinfer.backend.engine.streaming import Keepalive
from edgeinfer.protocol.wire import GenerateRequest, StreamChunk, Usage

__all__ = ["EngineObserver", "LLMEngine", "RequestError"]   # what callers import from here

log = logging.getLogger("edgeinfer.engine")


class LLMEngine(EngineCore):
    def validate(self, req: GenerateRequest) -> None:
        """Raises RequestError (with its HTTP-like code) naming what is wrong with req (backend/engine/requests.py)."""
        validate_request(self, req)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        """Yields StreamChunks; the last one carries finish_reason and usage. Cancelling the iterator aborts."""
        async for chunk in self.stream(req):
            assert chunk is not None     # no keepalive_s: no keepalives
            yield chunk

    async def stream(self, req: GenerateRequest, keepalive_s: float | None = None
                     ) -> AsyncGenerator[StreamChunk | None, None]:
        """stream_batches() one chunk at a time (None: a keepalive)."""
        batches = self.stream_batches(req, keepalive_s)
        try:
            async for batch in batches:
                if batch is None:
                    yield None
                    continue
                for chunk in batch:
                    yield chunk
        finally:
            await batches.aclose()

    async def stream_batches(self, req: GenerateRequest, keepalive_s: float | None = None
                             ) -> AsyncGenerator[list[StreamChunk] | None, None]:
        """The request's chunks, every chunk already delivered in one list (a reader that lags gets its
        backlog at once: one write, not one per token); the last chunk carries finish_reason and usage.
        A None each time `keepalive_s` passed without a chunk for this request while the engine completed a
        step since the last chunk or None: the request waits on a node that is working (queued or
        prefilling), not on a stuck one. One timer per stream, re-armed when it fires, not one per chunk.
        Cancelling the iterator aborts."""
        self.validate(req)
        matcher = await self._matcher(req)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamChunk | None] = asyncio.Queue()

        def emit(chunk: StreamChunk) -> None:      # engine thread: delivered in one batch per step (_flush)
            self._outbox.append((loop, q, chunk))

        seq = self._make_seq(req, emit)
        seq.matcher = matcher
        self._seqs[req.request_id] = seq
        self.backlog.submitted += len(seq.prompt_ids)
        self._cmds.put(("add", seq))
        finished = False
        beat = Keepalive(loop, q, keepalive_s, self) if keepalive_s is not None else None
        try:
            while True:
                item = q.get_nowait() if not q.empty() else await q.get()
                batch = [item] if item is not None else []
                while not q.empty():
                    item = q.get_nowait()
                    if item is not None:
                        batch.append(item)
                if beat is not None:
                    beat.saw_output()
                if not batch:
                    yield None
                    continue
                finished = batch[-1].finish_reason is not None
                yield batch
                if finished:
                    return
        finally:
            if beat is not None:
                beat.cancel()
            if not finished:
                self.abort(req.request_id)

    async def _matcher(self, req: GenerateRequest):
        if req.constraint is None:
            return None
        if self.grammars is None:
            raise RequestError("constrained decoding needs the model's tokenizer; this engine has none")
        try:
            return await self.grammars.matcher_async(req.constraint)
        except GrammarError as e:      # the request's own grammar: 422, which the gateway answers as a 400 naming it
            raise RequestError(str(e), GrammarFailed.code) from e

    async def call_in_engine(self, fn, *args):
        """Run fn(*args) on the engine thread between steps (safe access to blocks/runner); await its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(ok: bool, value) -> None:
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)

        def run() -> None:
            try:
                value, ok = fn(*args), True
            except Exception as e:  # delivered to the awaiting caller
                value, ok = e, False
            loop.call_soon_threadsafe(done, ok, value)

        if self._thread is None:
            run()
        else:
            self._cmds.put(("call", run))
        return await fut

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._cmds.put(("abort", seq))
        return True

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------ engine thread
    def _make_seq(self, req: GenerateRequest, emit) -> Sequence:
        sp = req.sampling
        max_new = min(sp.max_tokens, self.max_model_len - len(req.prompt_token_ids))

        def emit_seq(seq: Sequence, ids: list[int], lps: list | None, text: str, reason: str | None,
                     error: str | None = None, error_code: int = 500) -> None:
            usage = None
            if reason is not None:
                usage = Usage(len(seq.prompt_ids), len(seq.output_ids), seq.num_cached_prompt_tokens)
            prompt_lps = None
            if seq.prompt_lps is not None and len(seq.prompt_lps) == len(seq.prompt_ids) and error is None:
                prompt_lps, seq.prompt_lps = seq.prompt_lps, None    # whole, once, with the first chunk
            emit(StreamChunk(seq.request_id, token_ids=ids, text=text, logprobs=lps, prompt_logprobs=prompt_lps,
                             finish_reason=reason, usage=usage, error=error, error_code=error_code if error else None))

        seq = Sequence(req.request_id, req.prompt_token_ids, sp, self.key_context(req.cache_namespace), emit_seq,
                       req.tenant)
        seq.max_new_tokens = max_new
        seq.generator = make_generator(sp.seed) if sp.temperature > 0 else None
        seq.stop_checker = StopChecker(self.tokenizer, sp.stop, set(sp.stop_token_ids), self.eos_ids,
                                       sp.ignore_eos, req.prompt_token_ids)
        return seq
