"""Grammar-constrained decoding on llguidance: constraints compiled off the event loop and cached by hash,
one token bitmask for the whole batch per step.

A Constraint (protocol.wire) is a JSON Schema or a Lark grammar. `GrammarCompiler.matcher` returns a
fresh LLMatcher for one sequence: a deep copy of the cached compiled prototype (microseconds). Compiling
runs in a small thread pool under parser limits (LLParserLimits: lexer fuel, grammar size, Earley items),
so a pathological schema ends in an error state, reported as a 400 naming the limit, and a wall-clock
bound as a backstop; the event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance as llg
import numpy as np
import torch

from edgeinfer.protocol.tokenizer import Tokenizer
from edgeinfer.protocol.wire import Constraint

JSON_OPTIONS = {"whitespace_flexible": False}   # compact JSON: a small model cannot pad with endless blanks


@dataclass(frozen=True)
class GrammarLimits:
    max_spec_bytes: int = 256 << 10        # the schema or grammar text
    compile_timeout_s: float = 10.0        # backstop; the parser limits below end a costly compile first
    initial_lexer_fuel: int = 1_000_000    # llguidance's default (~20 ms of lexer construction)
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_grammar_size: int = 200_000
    max_lexer_states: int = 100_000
    cache_entries: int = 256
    mask_budget_s: float = 0.02            # one token's mask (or forced-token scan) for one request; 0: no budget
    probe_steps: int = 4                   # masks computed at compile time to measure the per-token cost

    def parser_limits(self) -> llg.LLParserLimits:
        return llg.LLParserLimits(initial_lexer_fuel=self.initial_lexer_fuel, step_lexer_fuel=self.step_lexer_fuel,
                                  step_max_items=self.step_max_items, max_grammar_size=self.max_grammar_size,
                                  max_lexer_states=self.max_lexer_states, verbose_errors=False)


class GrammarError(ValueError):
    """The constraint is invalid, unsupported or too costly: the request's fault (400)."""


def constraint_key(c: Constraint) -> str:
    return hashlib.sha256(f"{c.kind}\0{c.spec}".encode()).hexdigest()


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for a constraint; GrammarError when the spec is not valid JSON / a known kind."""
    if c.kind == "json_schema":
        try:
            return llg.LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(f"json_schema is not a JSON object: {e}") from e
    if c.kind == "lark":
        return llg.LLMatcher.grammar_from_lark(c.spec)
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.spec)
    raise GrammarError(f"constraint kind {c.kind!r} is not supported: expected 'json_schema', 'lark' or 'regex'")


class GrammarCompiler:
    """Per-engine: the llguidance tokenizer (built once, ~0.6 s), the compiled-grammar cache, the executor."""

    def __init__(self, tokenizer: Tokenizer, model_vocab: int, limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_vocab = model_vocab
        self.limits = limits or GrammarLimits()
        self._lltok: llg.LLTokenizer | None = None
        self._tok_lock = threading.Lock()
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._refused: OrderedDict[str, str] = OrderedDict()     # constraint key -> why (a costly grammar: once)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="edgeinfer-grammar", initializer=_lower_priority)
        self.executor = llg.LLExecutor(num_threads=2)
        self.compiles = 0
        self.hits = 0

    @property
    def lltok(self) -> llg.LLTokenizer:
        with self._tok_lock:
            if self._lltok is None:
                eos = sorted(self.tokenizer.eos_token_ids)
                self._lltok = llg.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.tokenizer.vocab_size,
                                              eos_token=eos or None)
            return self._lltok

    def compile(self, c: Constraint) -> llg.LLMatcher:
        """The cached prototype for c (compiled now if new); GrammarError if it cannot be compiled."""
        key = constraint_key(c)
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return proto
            refused = self._refused.get(key)
        if refused is not None:
            raise GrammarError(refused)
        if len(c.spec.encode()) > self.limits.max_spec_bytes:
            raise GrammarError(f"the {c.kind} is {len(c.spec.encode())} bytes: at most "
                               f"{self.limits.max_spec_bytes} are accepted")
        proto = llg.LLMatcher(self.lltok, grammar_text(c), log_level=0, limits=self.limits.parser_limits())
        if not proto.is_error():
            proto.compute_bitmask()     # the first mask builds the lexer: its limits are hit now, not mid-stream
        if proto.is_error():
            raise GrammarError(_explain(c, proto.get_error()))
        why = self._too_costly(c, proto)
        if why is not None:
            with self._lock:
                self._refused[key] = why
                while len(self._refused) > self.limits.cache_entries:
                    self._refused.popitem(last=False)
            raise GrammarError(why)
        with self._lock:
            self.compiles += 1
            self._cache[key] = proto
            while len(self._cache) > self.limits.cache_entries:
                self._cache.popitem(last=False)
        return proto

    def _too_costly(self, c: Constraint, proto: llg.LLMatcher) -> str | None:
        """Why a compiled grammar costs more per token than the budget, or None. Measured here, on the grammar
        pool (off the engine's step): a few masks and forced-token scans along the grammar's first allowed tokens.
        Measured on the default model's tokenizer, one thread (python -m benchmarks engine.grammar_budget): a JSON
        schema, a tool call or a plain regex 0.005 ms a mask; ((x{30}){30}){30} 6 ms (accepted); ((ab{50}){50}){50}
        22 ms and ((x{60}){60}){60} 54 ms a mask, about as much a scan (refused at the default 20 ms)."""
        budget = self.limits.mask_budget_s
        if budget <= 0:
            return None
        m = proto.deep_copy()
        worst = 0.0
        for _ in range(self.limits.probe_steps):
            t0 = time.perf_counter()
            mask = m.compute_bitmask()
            t1 = time.perf_counter()
            m.deep_copy().compute_ff_tokens()
            worst = max(worst, t1 - t0, time.perf_counter() - t1)
            if worst > budget or m.is_error() or m.is_stopped():
                break
            tok = _first_allowed(mask)
            if tok is None or not m.consume_token(tok):
                break
        if worst <= budget:
            return None
        return budget_message(c.kind, worst, budget)

    def matcher(self, c: Constraint) -> llg.LLMatcher:
        return self.compile(c).deep_copy()

    async def matcher_async(self, c: Constraint) -> llg.LLMatcher:
        """matcher(c) on the grammar pool: the event loop never runs a compile."""
        key = constraint_key(c)
        with self._lock:
            proto = self._cache.get(key)
        if proto is not None:
            self.hits += 1
            return proto.deep_copy()
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self.matcher, c)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.limits.compile_timeout_s)
        except TimeoutError as e:
            raise GrammarError(f"the {c.kind} is too costly to compile: not done in "
                               f"{self.limits.compile_timeout_s:g} s; simplify it") from e

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def budget_message(kind: str, took_s: float, budget_s: float) -> str:
    return (f"the {kind} is too costly per token: {took_s * 1e3:.0f} ms to compute one token's mask (the budget is "
            f"{budget_s * 1e3:.0f} ms, so that other requests' tokens are not held up); simplify it")


def _first_allowed(mask) -> int | None:
    """The lowest token id a bitmask (bytes or int32 words from compute_bitmask) allows."""
    words = np.frombuffer(bytes(mask), dtype=np.uint32)
    nz = np.flatnonzero(words)
    if not len(nz):
        return None
    w = int(words[nz[0]])
    return int(nz[0]) * 32 + ((w & -w).bit_length() - 1)


def _lower_priority() -> None:
    """Grammar-pool threads run at a lower CPU priority than the engine's step (Linux: per-thread nice), so a costly
    compile takes spare cycles, not the neighbours' steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _explain(c: Constraint, error: str) -> str:
    error = error.strip()
    if "limit" in error.lower() or "fuel" in error.lower() or "too many" in error.lower():
        return f"the {c.kind} is too costly to compile ({error}); simplify it"
    return f"invalid or unsupported {c.kind}: {error}"


# ---- the batch mask -------------------------------------------------------------------------------

_BITS = torch.arange(32, dtype=torch.int32)


def apply_masks(compiler: GrammarCompiler, matchers: list[tuple[int, llg.LLMatcher]], logits: torch.Tensor) -> None:
    """Set to -inf, in place, every token each matcher forbids; matchers: (row of logits, matcher).
    One parallel mask computation (LLExecutor) and one masked_fill for all constrained rows of the batch."""
    words = (compiler.lltok.vocab_size + 31) // 32
    bitmask = np.empty((len(matchers), words), dtype=np.int32)
    compiler.executor.unsafe_compute_mask_ptr([(m, j) for j, (_, m) in enumerate(matchers)],
                                              bitmask.ctypes.data, words * 4, len(matchers))
    bits = torch.from_numpy(bitmask)
    allowed = ((bits.unsqueeze(-1) >> _BITS) & 1).view(len(matchers), words * 32).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(len(matchers), vocab - allowed.shape[1])], 1)
    allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
    rows = [r for r, _ in matchers]
    with torch.inference_mode(logits.is_inference()):   # the model's logits are inference tensors
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            idx = torch.tensor(rows, device=logits.device)
            logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(~allowed, float("-inf")))
