"""LLMEngine: a step loop on its own thread; asyncio callers submit requests and read StreamChunks."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import torch
import xxhash

from edgeinfer.backend.engine.backlog import Backlog
from edgeinfer.backend.engine.block_manager import BlockManager
from edgeinfer.backend.engine.config import EngineConfig
from edgeinfer.backend.engine.fair import make_scheduler
from edgeinfer.backend.engine.grammar import GrammarCompiler, GrammarError
from edgeinfer.backend.engine.kv_integrity import KVIntegrity
from edgeinfer.backend.engine.model_runner import ModelRunner
from edgeinfer.backend.engine.sampler import (
    GrammarFailed,
    SamplingError,
    grammar_failed,
    make_generator,
    sample,
)
from edgeinfer.backend.engine.scheduler import Scheduler
from edgeinfer.backend.engine.sequence import SeqStatus, Sequence
from edgeinfer.backend.engine.step_cost import StepCost
from edgeinfer.backend.engine.stop import StopChecker
from edgeinfer.backend.engine.threads import ThreadGovernor
from edgeinfer.backend.model.llama import LlamaModel
from edgeinfer.protocol.page_id import PageKeyContext
from edgeinfer.protocol.tokenizer import Tokenizer
from edgeinfer.protocol.wire import GenerateRequest, StreamChunk, TokenLogprob, Usage

log = logging.getLogger("edgeinfer.engine")


class RequestError(ValueError):
    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


def model_fingerprint(path: str | Path) -> str:
    path = Path(path)
    h = xxhash.xxh3_64()
    h.update((path / "config.json").read_bytes() if (path / "config.json").is_file() else b"")
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 16))
    return h.hexdigest()


class EngineObserver:
    """Hooks for metrics and the page store; the defaults do nothing."""

    def on_step(self, engine: LLMEngine, batch, dt: float) -> None: ...
    def on_first_token(self, seq: Sequence, ttft: float) -> None: ...
    def on_token(self, seq: Sequence, itl: float) -> None: ...
    def on_finish(self, seq: Sequence) -> None: ...
    def on_pages_filled(self, seq: Sequence, pages: list[tuple[bytes, int]]) -> None: ...


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None, cfg: EngineConfig | None = None,
                 fingerprint: str = "", model_name: str = "model") -> None:
        self.cfg = cfg or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.runner = ModelRunner(model, self.cfg)
        self.max_model_len = min(self.cfg.max_model_len or model.cfg.max_position_embeddings,
                                 model.cfg.max_position_embeddings)
        self.blocks = BlockManager(self.runner.num_pages, self.cfg.page_size, self.cfg.enable_prefix_cache,
                                   tables=self.runner.tables, eviction=self.cfg.cache_eviction)
        self.blocks.check_identity = self.cfg.kv_integrity
        self.integrity = KVIntegrity(self.runner, self.blocks, self.cfg.kv_verify_fraction) \
            if self.cfg.kv_integrity else None
        if self.integrity is not None and self.cfg.kv_verify_fraction > 0:
            self.blocks.verify_content = self.integrity.verify
        self.step_cost = StepCost()                # what steps cost here (the fair scheduler's contended cap)
        self.scheduler = make_scheduler(self.cfg, self.blocks, self.step_cost)
        self.kv = self.runner.kv_format
        self.kv_format = self.kv.ident             # BackendInfo.kv_format, page identity
        self.fingerprint = fingerprint or f"{model.cfg.architecture}-{model.cfg.num_layers}-{model.cfg.hidden_size}"
        eos = set(model.cfg.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else set())
        self.eos_ids = eos
        self.grammars = GrammarCompiler(tokenizer, model.cfg.vocab_size) if tokenizer else None
        self.observers: list[EngineObserver] = []
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[str, Sequence] = {}
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, StreamChunk]] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self.backlog = Backlog(self.cfg.max_num_batched_tokens, step_cost=self.step_cost)
        self.threads: ThreadGovernor | None = None   # set on the engine thread (torch's thread count is per thread)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start (or restart after stop()) the step loop; requests already queued are kept."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="edgeinfer-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._cmds.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ------------------------------------------------------------ public API (any thread / asyncio)
    def key_context(self, namespace: str) -> PageKeyContext:
        return PageKeyContext(self.cfg.cache_seed, namespace, self.fingerprint, self.kv_format, self.cfg.page_size)

    def validate(self, req: GenerateRequest) -> None:
        try:
            req.sampling.validate()
        except ValueError as e:
            raise RequestError(str(e)) from e
        n = len(req.prompt_token_ids)
        if n == 0:
            raise RequestError("prompt_token_ids is empty: expected at least 1 token")
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is out of range: expected 0 <= id < {vocab}")
        if n >= self.max_model_len:
            raise RequestError(f"prompt has {n} tokens; this model accepts at most {self.max_model_len - 1}", 400)
        if self.blocks.pages_needed(n + 1) > self.blocks.num_pages:
            raise RequestError(f"prompt of {n} tokens needs {self.blocks.pages_needed(n + 1)} KV pages; the KV "
                               f"cache has {self.blocks.num_pages} pages of {self.cfg.page_size} tokens", 400)
        if req.request_id in self._seqs:
            raise RequestError(f"request_id {req.request_id!r} is already running", 409)
        if not req.cache_namespace:
            raise RequestError("cache_namespace is empty: expected the tenant's namespace")
        if req.tenant is not None:
            try:
                req.tenant.validate()
            except ValueError as e:
                raise RequestError(str(e)) from e
            cap = req.tenant.max_running_pages
            if cap and self.blocks.pages_needed(n + 1) > cap:
                raise RequestError(f"prompt of {n} tokens needs {self.blocks.pages_needed(n + 1)} KV pages; tenant "
                                   f"{req.tenant.id!r} may hold at most {cap} (max_running_pages)", 400)

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
        beat = _Keepalive(loop, q, keepalive_s, self) if keepalive_s is not None else None
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
        except GrammarError as e:
            raise RequestError(str(e)) from e

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
            emit(StreamChunk(seq.request_id, token_ids=ids, text=text, logprobs=lps, finish_reason=reason,
                             usage=usage, error=error, error_code=error_code if error else None))

        seq = Sequence(req.request_id, req.prompt_token_ids, sp, self.key_context(req.cache_namespace), emit_seq,
                       req.tenant)
        seq.max_new_tokens = max_new
        seq.generator = make_generator(sp.seed) if sp.temperature > 0 else None
        seq.stop_checker = StopChecker(self.tokenizer, sp.stop, set(sp.stop_token_ids), self.eos_ids,
                                       sp.ignore_eos, req.prompt_token_ids)
        return seq

    def _finish(self, seq: Sequence, reason: str, ids: list[int] | None = None, lps=None, text: str = "") -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._seqs.pop(seq.request_id, None)
        seq.emit(seq, ids or [], lps, text, reason)
        for o in self.observers:
            o.on_finish(seq)

    def _handle(self, cmd: str, seq: Any) -> None:
        # seq: the Sequence for "add" and "abort", a no-argument callable for "call", None for "wake"
        if cmd == "add":
            self.scheduler.add(seq)
            self.backlog.handled += len(seq.prompt_ids)
        elif cmd == "call":
            seq()
        elif cmd == "abort" and seq.status != SeqStatus.FINISHED:
            self._finish(seq, "abort", text=seq.stop_checker.flush() if seq.output_ids else "")

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.cfg.adaptive_threads and self.model.device.type == "cpu" and self.threads is None:
            self.threads = ThreadGovernor()
        while not self._stopping:
            try:
                block = not self.scheduler.has_work
                while True:
                    try:
                        cmd, seq = self._cmds.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    self._handle(cmd, seq)
                    block = False
                if self.scheduler.has_work:
                    if self.threads is not None:
                        self.threads.maybe_adjust()
                    self.step()
                elif self.backlog.queued_tokens:
                    self.backlog.observe(self.scheduler)      # everything ended or was aborted: nothing queued
                self._flush()
            except Exception as e:  # a failed step must not hang clients, nor fail the sequences it did not cause
                log.exception("engine step failed")
                self._isolate(e)
                self._flush()

    def _flush(self) -> None:
        """Hand this step's chunks to their event loops: one wake-up per loop, not one per chunk
        (per-chunk call_soon_threadsafe cost ~25% of decode throughput at 32 sequences)."""
        if not self._outbox:
            return
        out, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, q, chunk in out:
            by_loop.setdefault(loop, []).append((q, chunk))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:      # that loop is closed: its clients are gone
                pass

    def _finish_error(self, seq: Sequence, msg: str, code: int = 500) -> None:
        """End one sequence with an error chunk. code 500: this request failed on a healthy node (the gateway
        does not retry it); 503: the node failed (the gateway may retry elsewhere)."""
        if seq.status == SeqStatus.FINISHED:
            return
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "error"
        self._seqs.pop(seq.request_id, None)
        seq.emit(seq, [], None, "", "error", msg, code)
        for o in self.observers:
            o.on_finish(seq)

    def _isolate(self, error: Exception) -> None:
        """After a failed step: put every admitted sequence (and the queue, up to max_num_seqs) back to
        recompute, then run each alone until it yields a token. A sequence whose solo step fails is the
        culprit and ends with an error; the others carry on with the same tokens (recompute is exact).
        If every one of two or more fails alone, the node is at fault: they end with 503."""
        suspects = list(self.scheduler.running) + list(self.scheduler.waiting)
        if not suspects:
            return
        for seq in suspects:
            self.scheduler.remove(seq)          # frees its pages; the waiting queue is rebuilt below
            seq.num_computed_tokens = 0
            seq.page_hashes = []
            seq.status = SeqStatus.WAITING
        failed: list[tuple[Sequence, str]] = []
        rest = list(suspects)
        while rest and len(self.scheduler.running) < self.cfg.max_num_seqs:
            seq = rest.pop(0)
            outcome = self._probe(seq)
            if outcome == "stuck":               # no room alone right now: queue it with the rest
                rest.insert(0, seq)
                break
            if outcome is not None:
                failed.append((seq, outcome))
        self.scheduler.waiting.extendleft(reversed(rest))
        code = 503 if len(failed) == len(suspects) > 1 else 500
        for seq, msg in failed:
            self._finish_error(seq, msg, code)
        if failed:
            log.warning("step failure isolated: %d of %d sequence(s) failed alone (%s): %s", len(failed),
                        len(suspects), ", ".join(s.request_id for s, _ in failed), error)

    def _probe(self, seq: Sequence) -> str | None:
        """Run seq alone until it has a new token or finishes. None: fine (it is running again or
        finished); "stuck": it could not be scheduled alone; otherwise the failure's message."""
        solo = Scheduler(self.cfg, self.blocks)
        solo.add(seq)
        main, self.scheduler = self.scheduler, solo
        produced = len(seq.output_ids)
        try:
            while seq.status != SeqStatus.FINISHED and len(seq.output_ids) == produced:
                computed = seq.num_computed_tokens
                self.step()
                if seq.status != SeqStatus.FINISHED and seq.num_computed_tokens == computed \
                        and len(seq.output_ids) == produced:
                    solo.remove(seq)
                    seq.num_computed_tokens, seq.page_hashes, seq.status = 0, [], SeqStatus.WAITING
                    return "stuck"
        except Exception as e:  # this sequence fails alone: it is the culprit
            log.exception("request %s fails alone", seq.request_id)
            solo.remove(seq)
            return f"engine step failed on this request: {type(e).__name__}: {e}"
        finally:
            self.scheduler = main
            self._flush()
        if seq.status != SeqStatus.FINISHED:
            main.running.append(seq)
        return None

    def step(self) -> None:
        t0 = time.monotonic()
        batch = self.scheduler.schedule()
        for seq in batch.out_of_room:
            assert seq.stop_checker is not None   # set in _make_seq
            self._finish(seq, "length", text=seq.stop_checker.flush())
        if self.integrity is not None and not batch.empty:
            self._check_pages(batch)
        if batch.empty:
            return
        seqs, logits = self.runner.execute(batch)
        sealed: list[int] = []
        for s in [*batch.decodes, *(s for s, _ in batch.prefills)]:
            new = s.extend_hashes()
            if new:
                cached = self.blocks.register_full_pages(s, new)
                if cached:
                    sealed += [page for _, page in cached]
                    for o in self.observers:
                        o.on_pages_filled(s, cached)
        if sealed and self.integrity is not None:
            self.integrity.seal(sealed)
        now = time.monotonic()
        if seqs:
            for seq, got in zip(seqs, sample(seqs, logits, self.grammars)):
                self._take(seq, got, now)
        self.steps += 1
        dt = time.monotonic() - t0
        prefill = sum(n for _, n in batch.prefills)
        self.backlog.on_step(self.scheduler, len(batch.decodes) + prefill, dt)
        self.step_cost.observe(len(batch.decodes), prefill, dt)
        for o in self.observers:
            o.on_step(self, batch, dt)

    def _check_pages(self, batch) -> None:
        """Before the forward pass: a scheduled sequence whose table names a page it does not hold gives back the
        pages it does hold (BlockManager.repair finds one its table lost) and waits first in line to be recomputed
        (it reads and writes no page this step)."""
        assert self.integrity is not None
        bad = self.integrity.check_batch([*batch.decodes, *(s for s, _ in batch.prefills)])
        if not bad:
            return
        out = {id(s) for s, _ in bad}
        for seq, entries in bad:
            for i in entries:
                self.blocks.repair(seq, i)
            self.scheduler.requeue(seq)
        batch.decodes = [s for s in batch.decodes if id(s) not in out]
        batch.prefills = [(s, n) for s, n in batch.prefills if id(s) not in out]

    def _take(self, seq: Sequence, got: tuple[int, TokenLogprob | None] | SamplingError, now: float) -> None:
        """Append a sampled token; a failure (sampling, stop check, detokenizing) ends this sequence only."""
        try:
            if isinstance(got, SamplingError):
                raise got
            self._append_token(seq, got[0], got[1], now)
        except Exception as e:
            if isinstance(e, GrammarFailed):
                log.info("request %s: %s", seq.request_id, e)
                self._finish_error(seq, str(e), e.code)
                return
            log.warning("request %s failed: %s: %s", seq.request_id, type(e).__name__, e)
            self._finish_error(seq, f"generation failed: {e}" if isinstance(e, SamplingError)
                               else f"generation failed: {type(e).__name__}: {e}")

    def _append_token(self, seq: Sequence, tok: int, lp: TokenLogprob | None, now: float) -> None:
        seq.output_ids.append(tok)
        if seq.first_token_time is None:
            seq.first_token_time = now
            for o in self.observers:
                o.on_first_token(seq, now - seq.arrival)
        else:
            assert seq.last_token_time is not None   # set together with first_token_time
            for o in self.observers:
                o.on_token(seq, now - seq.last_token_time)
        seq.last_token_time = now
        assert seq.stop_checker is not None   # set in _make_seq
        text, stopped = seq.stop_checker.push(tok)
        if seq.matcher is not None and not stopped:
            stopped = _grammar_done(seq, tok)
            if stopped:
                text += seq.stop_checker.flush()
        lps = [lp] if lp is not None else None
        if stopped:
            self._finish(seq, "stop", [tok], lps, text)
        elif len(seq.output_ids) >= seq.max_new_tokens:
            self._finish(seq, "length", [tok], lps, text + seq.stop_checker.flush())
        else:
            seq.emit(seq, [tok], lps, text, None)


def _grammar_done(seq: Sequence, tok: int) -> bool:
    """Advance the grammar by the accepted token; True when it admits nothing more (output complete)."""
    m = seq.matcher
    assert m is not None
    if not m.consume_token(tok):
        raise grammar_failed(seq, m.get_error())
    return m.is_stopped()


class _Keepalive:
    """Puts a None (keepalive) into a stream's queue after `every_s` without output, if the engine stepped
    since the stream's last output: one loop timer per stream, moved only when it fires."""

    __slots__ = ("loop", "q", "every_s", "engine", "last", "seen_steps", "handle")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, every_s: float, engine: LLMEngine) -> None:
        self.loop, self.q, self.every_s, self.engine = loop, q, every_s, engine
        self.last = loop.time()
        self.seen_steps = engine.steps
        self.handle = loop.call_at(self.last + every_s, self._fire)

    def saw_output(self) -> None:
        """The stream passed on a chunk or a keepalive: the silence starts again."""
        self.last = self.loop.time()
        self.seen_steps = self.engine.steps

    def _fire(self) -> None:
        now = self.loop.time()
        due = self.last + self.every_s
        if now < due:
            self.handle = self.loop.call_at(due, self._fire)
            return
        if self.engine.steps != self.seen_steps:
            self.seen_steps = self.engine.steps
            self.q.put_nowait(None)
        self.last = now
        self.handle = self.loop.call_at(now + self.every_s, self._fire)

    def cancel(self) -> None:
        self.handle.cancel()


def _deliver(items: list) -> None:
    for q, chunk in items:
        q.put_nowait(chunk)


def in_fresh_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a new thread that exits when it returns; its result, or its exception.

    For torch work on CPU outside the engine thread (loading a model). libgomp gives every thread that
    runs a parallel region its own worker pool, kept until that thread exits; once the pools hold more
    threads than there are CPUs, every worker spins only 100 times before sleeping, so each of the ~600
    parallel ops of a decode step pays a futex wake-up (measured at 32 sequences on 2 cores: 52 ms per
    step with one pool, 70 ms once the main thread has a pool too). A thread that exits frees its pool.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name="edgeinfer-torch-oneshot")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


def load_engine(model_dir: str | Path, cfg: EngineConfig | None = None, dtype: torch.dtype = torch.float32,
                device: str = "cpu", model_name: str | None = None) -> LLMEngine:
    """Load on a thread that exits (see in_fresh_thread): the engine thread's OpenMP pool stays the only one."""
    return in_fresh_thread(_load_engine, model_dir, cfg, dtype, device, model_name)


def _load_engine(model_dir, cfg, dtype, device, model_name) -> LLMEngine:
    from edgeinfer.backend.model.llama import load_model

    model_dir = Path(model_dir)
    model = load_model(model_dir, dtype=dtype, device=device)
    tok = Tokenizer.from_dir(model_dir, model_vocab_size=model.cfg.vocab_size)
    return LLMEngine(model, tok, cfg, fingerprint=model_fingerprint(model_dir), model_name=model_name or model_dir.name)
