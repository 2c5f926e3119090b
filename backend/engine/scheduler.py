"""Continuous batching with chunked prefill and recompute preemption."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from edgeinfer.backend.engine.block_manager import BlockManager
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)   # (seq, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    out_of_room: list[Sequence] = field(default_factory=list)           # can't grow even alone -> finish "length"
    verifies: list[tuple[Sequence, list[int]]] = field(default_factory=list)   # (seq, draft): k+1 tokens, all logits

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def prefill_per_step(self, decodes: int) -> int:
        """Prefill tokens a step with `decodes` decoding sequences would compute now (the overload estimate)."""
        return max(1, self.cfg.max_num_batched_tokens - decodes)

    def charge_extra(self, seq: Sequence, tokens: int) -> None:
        """Decode tokens a verify step emitted beyond the one its decode was charged for (the fair scheduler's
        counters; FIFO keeps none)."""

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def _preempt(self, victim: Sequence, batch: ScheduledBatch) -> None:
        self.requeue(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)

    def requeue(self, seq: Sequence) -> None:
        """A running seq gives back its pages and waits first in line to be recomputed (its output so far kept)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.page_hashes = []
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _victim(self, seq: Sequence, protected: set[int]) -> Sequence | None:
        """Whom to preempt so that seq can grow: the newest other running sequence not scheduled yet."""
        return next((s for s in reversed(self.running) if s is not seq and id(s) not in protected), None)

    def _grow(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, protected: set[int]) -> bool:
        """Make room for seq to hold num_tokens, preempting (self._victim) if needed."""
        while not self.blocks.ensure_capacity(seq, num_tokens):
            victim = self._victim(seq, protected)
            if victim is None:
                return False
            self._preempt(victim, batch)
        return True

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq not in self.running:      # preempted while making room for an older one
                continue
            if self._schedule_decode(seq, batch, scheduled):
                budget -= 1
        for seq in [s for s in self.running if s.is_prefilling]:
            if budget <= 0:
                break
            if seq not in self.running:
                continue
            budget -= self._schedule_chunk(seq, budget, batch, scheduled)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget, batch):
                break
            self.waiting.popleft()
            budget -= self._add_prefill(seq, min(seq.num_uncomputed, budget), batch, scheduled)
        return batch

    def _stuck(self, seq: Sequence) -> bool:
        """seq cannot grow and preempting it would free room for nobody: it is reported out of room."""
        return len(self.running) == 1

    def _schedule_decode(self, seq: Sequence, batch: ScheduledBatch, scheduled: set[int]) -> bool:
        """One decode token for a running seq, making room as needed (else seq is preempted or out of room)."""
        if not self._grow(seq, seq.num_computed_tokens + 1, batch, scheduled):
            if self._stuck(seq):
                batch.out_of_room.append(seq)
            else:
                self._preempt(seq, batch)
            return False
        batch.decodes.append(seq)
        scheduled.add(id(seq))
        return True

    def _schedule_chunk(self, seq: Sequence, budget: int, batch: ScheduledBatch, scheduled: set[int]) -> int:
        """The next prefill chunk of a running seq within budget, making room as needed; its tokens (0: none)."""
        n = min(seq.num_uncomputed, budget)
        if not self._grow(seq, seq.num_computed_tokens + n, batch, scheduled):
            return 0
        return self._add_prefill(seq, n, batch, scheduled)

    @staticmethod
    def _add_prefill(seq: Sequence, n: int, batch: ScheduledBatch, scheduled: set[int]) -> int:
        batch.prefills.append((seq, n))
        scheduled.add(id(seq))
        return n

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> bool:
        hashes = seq.prompt_page_hashes()
        p = self.blocks.page_size
        while True:          # a prefix page that fails its content check is dropped: match again (ends: one fewer)
            pages = list(self.blocks.match_prefix(seq, hashes).pages)
            if len(pages) * p >= seq.num_tokens:     # keep >= 1 token to compute (its logits are needed)
                pages = pages[:-1]
            cached = len(pages) * p
            n = min(seq.num_tokens - cached, budget)
            need = self.blocks.pages_needed(cached + n) - len(pages)
            if not self.blocks.can_allocate(need, pages):
                return False
            if self.blocks.verify_taken(seq, pages, hashes[:len(pages)]):
                break
        self.blocks.assign(seq, pages)
        self.blocks.allocate(seq, need)
        seq.num_computed_tokens = cached
        seq.page_hashes = list(hashes[: len(pages)])
        if not seq.admitted_once:
            seq.admitted_at = time.monotonic()
            seq.num_cached_prompt_tokens = cached
            seq.admitted_once = True
            self.blocks.queries += len(seq.prompt_ids)
            self.blocks.hits += cached
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True
