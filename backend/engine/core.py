"""EngineCore: the engine's step loop on its own thread (init, loop, step, take / append, finish, flush); the
asyncio face that callers use is LLMEngine (backend/engine/engine.py)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

import torch

from edgeinfer.backend.engine.backlog import Backlog
from edgeinfer.backend.engine.block_manager import BlockManager
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.fair import make_scheduler
from edgeinfer.backend.engine.grammar import GrammarCompiler, GrammarLimits, budget_message
from edgeinfer.backend.engine.isolation import isolate
from edgeinfer.backend.engine.kv_integrity import KVIntegrity
from edgeinfer.backend.engine.kv_port import EngineKVPort
from edgeinfer.backend.engine.model_runner import ModelRunner
from edgeinfer.backend.engine.observer import EngineObserver
from edgeinfer.backend.engine.sampler import (
    GrammarFailed,
    SamplingError,
    grammar_failed,
    sample,
)
from edgeinfer.backend.engine.sequence import SeqStatus, Sequence
from edgeinfer.backend.engine.spec.driver import SpecDriver
from edgeinfer.backend.engine.step_cost import StepCost
from edgeinfer.backend.engine.threads import ThreadGovernor
from edgeinfer.backend.model.paged import PagedModel
from edgeinfer.protocol.page_id import PageKeyContext
from edgeinfer.protocol.tokenizer import Tokenizer
from edgeinfer.protocol.wire import StreamChunk, TokenLogprob

log = logging.getLogger("edgeinfer.engine")


class EngineCore:
    def __init__(self, model: PagedModel, tokenizer: Tokenizer | None, cfg: EngineConfig | None = None,
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
        self._integrity = KVIntegrity(self.runner, self.blocks, self.cfg.kv_verify_fraction)
        self.integrity: KVIntegrity | None = None
        self.set_kv_integrity(self.cfg.kv_integrity)
        self.kv_port = EngineKVPort(self)           # what the page store may do with this engine's KV
        self.step_cost = StepCost()                # what steps cost here (the fair scheduler's contended cap)
        self.scheduler = make_scheduler(self.cfg, self.blocks, self.step_cost)
        self.kv = self.runner.kv_format
        self.kv_format = self.kv.ident             # BackendInfo.kv_format, page identity
        self.fingerprint = fingerprint or f"{model.cfg.architecture}-{model.cfg.num_layers}-{model.cfg.hidden_size}"
        eos = set(model.cfg.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else set())
        self.eos_ids = eos
        self.grammars = GrammarCompiler(tokenizer, model.cfg.vocab_size,
                                        GrammarLimits(mask_budget_s=self.cfg.grammar_mask_budget_s)) \
            if tokenizer else None
        self.observers: list[EngineObserver] = []
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[str, Sequence] = {}
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, StreamChunk]] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self.backlog = Backlog(self.cfg.max_num_batched_tokens, step_cost=self.step_cost)
        self.spec = self.cfg.spec_policy()
        if self.spec.method == "mtp" and model.mtp is None:
            raise ValueError("speculative='mtp' needs the checkpoint's MTP layer loaded (num_nextn_predict_layers >= 1, "
                             "DeepSeek-V3 / Kimi K2 / GLM-4.5 class; one process, not tensor-parallel): "
                             f"{model.cfg.architecture} here has num_nextn_predict_layers="
                             f"{model.cfg.num_nextn_predict_layers}; use 'ngram' or 'off'")
        self.speculation = SpecDriver(self.spec, self.blocks, self.scheduler, self.cfg.max_num_batched_tokens,
                                      lambda: self.step_cost.coef, self.runner.mtp)   # backend/engine/spec/
        self.fast_forwarded = 0        # tokens a grammar forced, emitted without a model step each
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

    def set_kv_integrity(self, on: bool) -> None:
        """The live pool's checks on or off (EngineConfig.kv_integrity at start; benchmarks toggle it on the engine
        thread): identity before each step and at hits and frees, checksums at seal and reuse."""
        self.integrity = self._integrity if on else None
        self.blocks.check_identity = on
        self.blocks.verify_content = self._integrity.verify if on and self.cfg.kv_verify_fraction > 0 else None

    # ------------------------------------------------------------ public API (any thread / asyncio)
    def key_context(self, namespace: str) -> PageKeyContext:
        return PageKeyContext(self.cfg.cache_seed, namespace, self.fingerprint, self.kv_format, self.cfg.page_size)

    def _finish(self, seq: Sequence, reason: str, ids: list[int] | None = None, lps=None, text: str = "") -> None:
        if seq.status == SeqStatus.FINISHED:
            return
        self.scheduler.remove(seq)
        self._close(seq, reason, ids, lps, text)

    def _close(self, seq: Sequence, reason: str, ids: list[int] | None = None, lps=None, text: str = "",
               error: str | None = None, code: int = 500) -> None:
        """seq is over (its pages already given back): its last chunk out, the observers told."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._seqs.pop(seq.request_id, None)
        seq.emit(seq, ids or [], lps, text, reason, error, code)
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
                self.flush()
            except Exception as e:  # a failed step must not hang clients, nor fail the sequences it did not cause
                log.exception("engine step failed")
                try:
                    isolate(self, e)
                except Exception:  # the recovery failed too: end every request (503) rather than hang them all
                    log.exception("isolating the failed step failed: ending every request with 503")
                    self._fail_all("the engine failed and could not isolate the cause; retry elsewhere")
                self.flush()

    def _fail_all(self, msg: str) -> None:
        """End every admitted and queued request with a 503 error chunk, even where giving back its pages fails
        (their bookkeeping is what broke); the loop then goes on with an empty batch."""
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting) + list(self._seqs.values())
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        for seq in dict.fromkeys(seqs):
            if seq.status == SeqStatus.FINISHED:
                continue
            try:
                self.blocks.free(seq)
            except Exception:  # noqa: BLE001 - pages lost with the broken bookkeeping
                log.exception("request %s: its pages could not be given back", seq.request_id)
            self._close(seq, "error", error=msg, code=503)

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is live in the engine (a second one is refused)."""
        return request_id in self._seqs

    def is_alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def flush(self) -> None:
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

    def finish_error(self, seq: Sequence, msg: str, code: int = 500) -> None:
        """End one sequence with an error chunk. code 500: this request failed on a healthy node (the gateway
        does not retry it); 503: the node failed (the gateway may retry elsewhere)."""
        if seq.status == SeqStatus.FINISHED:
            return
        self.scheduler.remove(seq)
        self._close(seq, "error", error=msg, code=code)

    def step(self) -> None:
        t0 = time.monotonic()
        batch = self.scheduler.schedule()
        for seq in batch.out_of_room:
            assert seq.stop_checker is not None   # set in _make_seq
            self._finish(seq, "length", text=seq.stop_checker.flush())
        self.speculation.draft(batch, self.steps)
        if self.integrity is not None and not batch.empty:
            self._check_pages(batch)
        if batch.empty:
            return
        out = self.runner.execute(batch)
        seqs, logits = out.seqs, out.logits
        for s, start, rows in out.prompt_logits:
            self._prompt_logprobs(s, start, rows)
        verified = self.speculation.accept(batch, out.verify_logits, self.steps)
        pending = {id(s): d[:s.num_computed_tokens - s.num_tokens] for (s, d) in batch.verifies}   # accepted drafts
        sealed: list[int] = []
        for s in [*batch.decodes, *(s for s, _ in batch.prefills), *(s for s, _ in batch.verifies)]:
            accepted = pending.get(id(s))
            new = s.extend_hashes(accepted)
            if new:
                cached = self.blocks.register_full_pages(s, new, accepted)
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
        for (seq, _), toks in zip(batch.verifies, verified):
            if isinstance(toks, SamplingError):
                self._take(seq, toks, now)
                continue
            for tok in toks:
                if seq.status == SeqStatus.FINISHED:
                    break
                self._take(seq, (tok, None), now)
        self.speculation.after_step(batch, out.step_rows)
        self.steps += 1
        dt = time.monotonic() - t0
        prefill = sum(n for _, n in batch.prefills)
        decodes = len(batch.decodes) + sum(len(d) + 1 for _, d in batch.verifies)    # a verify: k+1 decode rows
        self.backlog.on_step(self.scheduler, decodes + prefill, dt)
        self.step_cost.observe(decodes, prefill, dt)
        for o in self.observers:
            o.on_step(self, batch, dt)

    @staticmethod
    def _prompt_logprobs(seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """Entries start+1.. of seq's prompt logprobs from the logits at positions start.. (rows [n, vocab]); an entry
        it already has (a chunk recomputed after a preemption) is kept."""
        lps = seq.prompt_lps
        assert lps is not None
        skip = len(lps) - 1 - start           # positions already turned into entries
        if skip >= rows.shape[0]:
            return
        rows = rows[max(skip, 0):]
        first = start + max(skip, 0)
        targets = torch.tensor(seq.prompt_ids[first + 1:first + 1 + rows.shape[0]], dtype=torch.long)
        logp = torch.log_softmax(rows.float(), dim=-1)
        chosen = logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        k = seq.sampling.prompt_logprobs or 0
        if k:
            v, ix = logp.topk(k, dim=-1)
            tops = [list(zip(i, x)) for i, x in zip(ix.tolist(), v.tolist())]
        else:
            tops = [[] for _ in chosen]
        lps += [TokenLogprob(t, c, top) for t, c, top in zip(targets.tolist(), chosen, tops)]

    def _check_pages(self, batch) -> None:
        """Before the forward pass: a scheduled sequence whose table names a page it does not hold gives back the
        pages it does hold (BlockManager.repair finds one its table lost) and waits first in line to be recomputed
        (it reads and writes no page this step)."""
        assert self.integrity is not None
        bad = self.integrity.check_batch([*batch.decodes, *(s for s, _ in batch.prefills),
                                          *(s for s, _ in batch.verifies)])
        if not bad:
            return
        out = {id(s) for s, _ in bad}
        for seq, entries in bad:
            for i in entries:
                self.blocks.repair(seq, i)
            self.scheduler.requeue(seq)
        batch.decodes = [s for s in batch.decodes if id(s) not in out]
        batch.prefills = [(s, n) for s, n in batch.prefills if id(s) not in out]
        batch.verifies = [(s, d) for s, d in batch.verifies if id(s) not in out]

    def _take(self, seq: Sequence, got: tuple[int, TokenLogprob | None] | SamplingError, now: float) -> None:
        """Append a sampled token; a failure (sampling, stop check, detokenizing) ends this sequence only."""
        try:
            if isinstance(got, SamplingError):
                raise got
            self._append_token(seq, got[0], got[1], now)
            if seq.matcher is not None and self.cfg.grammar_fast_forward and seq.status != SeqStatus.FINISHED \
                    and not seq.sampling.logprobs:
                self._fast_forward(seq, now)
        except Exception as e:
            if isinstance(e, GrammarFailed):
                log.info("request %s: %s", seq.request_id, e)
                self.finish_error(seq, str(e), e.code)
                return
            log.warning("request %s failed: %s: %s", seq.request_id, type(e).__name__, e)
            self.finish_error(seq, f"generation failed: {e}" if isinstance(e, SamplingError)
                               else f"generation failed: {type(e).__name__}: {e}")

    def _fast_forward(self, seq: Sequence, now: float) -> None:
        """Grammar fast-forward (SGLang's jump-forward): the tokens the grammar allows as the only continuation (a
        JSON key, punctuation, a tool call's fixed parts: llguidance's compute_ff_tokens) are appended at once, each
        emitted and consumed like a sampled token; their KV is then computed in one chunk with the next step (the
        sequence has more than one uncomputed token: it is scheduled as a prefill chunk), whose last logits sample
        the next free token. No model step per forced token."""
        m = seq.matcher
        assert m is not None
        budget = self.cfg.grammar_mask_budget_s
        while seq.status != SeqStatus.FINISHED and not m.is_stopped():
            t0 = time.perf_counter()
            forced = m.compute_ff_tokens()
            took = time.perf_counter() - t0
            if budget > 0 and took > budget:     # measured per request, in the step: twice over it and it ends
                seq.grammar_over_budget += 1
                if seq.grammar_over_budget >= 2:
                    raise GrammarFailed(budget_message("grammar", took, budget))
            if not forced:
                return
            for tok in forced:
                if seq.status == SeqStatus.FINISHED:
                    return
                self._append_token(seq, tok, None, now)
                self.fast_forwarded += 1

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


def _deliver(items: list) -> None:
    for q, chunk in items:
        q.put_nowait(chunk)
