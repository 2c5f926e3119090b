"""The speculative driver: what the engine step calls, three times (backend/engine/engine.py step):
  draft(batch)             before the forward pass: decodes whose drafts pay become verify chunks (policy.plan),
                           while the step's decoding sequences are at most max_batch and the drafts' pages fit (no
                           preemption for a draft); drafts take what is left of the step's token budget;
  accept(batch, out)       after it: each verify chunk's emitted tokens (verify.py), its KV counted up to the last
                           accepted draft token, the acceptance recorded;
  after_step(batch, out)   speculative 'mtp': the MTP layer runs over the positions this step computed and counted
                           (a verify: up to its last accepted token), each paired with the token after it, which
                           stores its KV there; its prediction at a sequence's last position is that sequence's draft
                           for the next step.
Counters in SpecStats (the backend's /metrics reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgeinfer.backend.engine.sampler import SamplingError
from edgeinfer.backend.engine.sequence import SeqStatus, Sequence
from edgeinfer.backend.engine.spec import policy as spec_policy
from edgeinfer.backend.engine.spec.mtp import MTPRunner
from edgeinfer.backend.engine.spec.policy import SpecPolicy
from edgeinfer.backend.engine.spec.proposers import MTPProposer, proposer_for
from edgeinfer.backend.engine.spec.verify import verify

if TYPE_CHECKING:
    from collections.abc import Callable

    from edgeinfer.backend.engine.block_manager import BlockManager
    from edgeinfer.backend.engine.scheduler import ScheduledBatch, Scheduler


@dataclass
class SpecStats:
    steps: int = 0          # verify chunks run
    drafted: int = 0        # draft tokens verified
    accepted: int = 0       # of those, accepted


class SpecDriver:
    def __init__(self, policy: SpecPolicy, blocks: BlockManager, scheduler: Scheduler, max_batched_tokens: int,
                 step_cost: Callable[[], tuple[float, float, float] | None], mtp: MTPRunner | None) -> None:
        self.policy, self.blocks, self.scheduler = policy, blocks, scheduler
        self.max_batched_tokens, self.step_cost, self.mtp = max_batched_tokens, step_cost, mtp
        self.proposer = proposer_for(policy)
        self.stats = SpecStats()

    def draft(self, batch: ScheduledBatch, step: int) -> None:
        if self.policy.method == "off" or not batch.decodes or len(batch.decodes) > self.policy.max_batch:
            return
        prefill = sum(n for _, n in batch.prefills)
        room = self.max_batched_tokens - len(batch.decodes) - prefill
        drafts = [(seq, d) for seq in batch.decodes if spec_policy.eligible(seq)
                  for d in [self.proposer.propose(seq, self.policy)] if d]
        if not drafts or room <= 0:
            return
        ks = spec_policy.plan(drafts, self.policy, step, len(batch.decodes), prefill, self.step_cost())
        chosen: dict[int, list[int]] = {}
        for (seq, d), k in zip(drafts, ks):
            k = min(k, room)
            if k > 0 and self.blocks.ensure_capacity(seq, seq.num_computed_tokens + 1 + k):
                chosen[id(seq)] = d[:k]
                room -= k
        if chosen:
            batch.verifies = [(s, chosen[id(s)]) for s in batch.decodes if id(s) in chosen]
            batch.decodes = [s for s in batch.decodes if id(s) not in chosen]

    def accept(self, batch: ScheduledBatch, verify_logits: list, step: int) -> list[list[int] | SamplingError]:
        return [self._accept_one(s, d, rows, step) for (s, d), rows in zip(batch.verifies, verify_logits)]

    def _accept_one(self, seq: Sequence, draft: list[int], rows, step: int) -> list[int] | SamplingError:
        """The tokens a verify chunk emits; its KV counts up to the last accepted draft token."""
        try:
            out, accepted = verify(seq, draft, rows)
        except SamplingError as e:
            seq.num_computed_tokens += 1
            return e
        seq.num_computed_tokens += 1 + accepted
        if accepted:
            self.scheduler.charge_extra(seq, accepted)
        self.stats.steps += 1
        self.stats.drafted += len(draft)
        self.stats.accepted += accepted
        spec_policy.record(seq, len(draft), accepted, step)
        return out

    def after_step(self, batch: ScheduledBatch, step_rows: dict[int, tuple[int, int, int]]) -> None:
        if self.mtp is None:
            return
        items = []
        for s in [*batch.decodes, *(s for s, _ in batch.prefills), *(s for s, _ in batch.verifies)]:
            if s.status == SeqStatus.FINISHED or not spec_policy.eligible(s):
                continue
            p0 = step_rows[id(s)][1]
            n = min(s.num_computed_tokens, len(s.all_ids) - 1) - p0
            if n > 0:
                items.append((s, n))
        if not items:
            return
        drafts = self.mtp.step(items).argmax(-1).tolist()
        for (s, _), d in zip(items, drafts):
            if s.num_computed_tokens == s.num_tokens - 1:    # decoding next: the draft follows its last token
                MTPProposer.keep(s, self.policy, [d])
