"""Tenant-fair scheduling: the Virtual Token Counter (VTC) of "Fairness in Serving Large Language Models"
(Sheng et al., OSDI 2024), with weights, priority classes and per-tenant page caps.

Counter. Each tenant t has c_t, the service it received divided by its weight:
    c_t += (prefill_token_weight * prefill tokens + decode_token_weight * decode tokens) / weight_t
charged as a step is scheduled (with chunked prefill each chunk is charged when it runs, not the whole prompt
at admission as in the paper; a preempted sequence's recompute is charged again: it costs the same).
Defaults w_p = 1, w_q = 2 (the paper's choice: a decode token costs about twice a prefill token).

Lift. A tenant that becomes backlogged (no request waiting or running before) has its counter raised to the
smallest counter of the backlogged tenants, or, when none is, to the counter of the last tenant that left
(the paper's Algorithm 2): time spent idle is not banked as credit.

Order. Admission, and the prefill share of each step's token budget, go to the tenant with the smallest
(priority class, counter), its oldest waiting request first; the counter includes what this step already
gave it, so one step's budget is split between tenants. Every running decode gets its token each step
(as in VTC, fairness acts on admission and prefill, never by stalling a decode).

Priority classes. Strict (0 first), with aging: a request's class improves by one for every
priority_aging_steps steps it has waited, so a low class is delayed, never starved. Within a class no
tenant starves either: a backlogged tenant's counter stays put while the others' grow.

Preemption for fairness (fair_preemption). VTC alone only reorders admission: a tenant arriving while another
holds every batch slot waits for one of its requests to finish. Here, when every slot is held and the next
waiting request (in the order above) belongs to a tenant below its slot share, max_num_seqs * weight / (sum of
the backlogged tenants' weights), a tenant that keeps at least its share after losing one slot and whose
(class, counter) is larger gives up its running sequence with the least KV computed (recompute: the output so
far is kept, the tokens are recomputed exactly, and the full pages stay in the prefix cache). One per step; a
request is preempted for fairness at most max_fair_preemptions times, so every request finishes.

Prefill isolation (prefill_isolation). Once a step has given prefill tokens to a request still waiting for its
first token, of a tenant within its slot share, the rest of that step's prefill budget goes to no other
tenant whose (class, counter) is larger, nor to one over (or that an admission would take over) its share;
their decodes still run, their prefill waits for the next step. The first token of the tenant served least is
not delayed by the flooding tenant's prompts (in the step time); prefill batching across tenants is what it
costs. No starvation: the shielded tenant's counter grows with what it is served, and order is by counter.

Contended step budget (contended_step_ratio, contended_step_tokens, contended_window_s). No scheduler can
interrupt a forward pass: a request arriving while a step runs waits for it to end, and a step with a full
prefill budget (512 tokens) is the longest there is. While more than one tenant is active (backlogged, or its
last request left less than contended_window_s ago, so a closed-loop client between two requests still counts)
a step's prefill tokens, whoever they go to, are capped so the step in flight when another tenant's request
arrives stays short. The cap comes from what steps cost on this machine (backend.engine.step_cost, fitted on
the engine's own steps): the most prefill tokens whose predicted time is at most contended_step_ratio times
the rest of the step (its decodes and fixed cost), at least CONTENDED_MIN_TOKENS. So a contended step lasts at
most about (1 + ratio) times the step it would be without prefill: on a CPU, where each token is its own work,
a few dozen tokens; where a step's time barely grows with its tokens (a GPU at small batch) the cap exceeds the
budget and nothing changes. Until the fit exists (the first steps), and with contended_step_ratio 0, the cap is
contended_step_tokens; 0 there turns the contended budget off. Decodes are not capped (one token per running
sequence). With one tenant active (and none within the window) the step takes max_num_batched_tokens as
before: nothing changes for a lone tenant. Costs prefill batching (each step's fixed cost is paid per capped
step, not per full budget); never starves: every step with prefill work gives at least one token.

Preemption (out of KV pages). The victim is the newest running sequence of the tenant most over its share:
the lowest class (largest number), then the largest counter. A tenant's cap (TenantSpec.max_running_pages)
bounds the pages its running sequences hold: it waits (admission) or preempts its own newest sequence
(growth); a sole sequence at its cap ends with "length".
"""

from __future__ import annotations

import time
from collections import Counter

from edgeinfer.backend.engine.block_manager import BlockManager
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.scheduler import ScheduledBatch, Scheduler
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.backend.engine.step_cost import StepCost

CONTENDED_MIN_TOKENS = 16       # the least a contended step's prefill is capped to (the flooder still progresses)


class FairScheduler(Scheduler):
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, step_cost: StepCost | None = None) -> None:
        super().__init__(cfg, blocks)
        self.step_cost = step_cost        # the engine's measure of step times (None: the fixed token cap only)
        self.contended_cap = 0            # the prefill cap of the last contended step (a gauge; 0: none yet)
        self.counters: dict[str, float] = {}
        self.steps = 0
        self._last_left = 0.0
        self.num_fair_preemptions = 0
        self.num_contended_steps = 0      # steps whose prefill budget the contended cap lowered
        self.clock = time.monotonic       # for the contended window (tests substitute their own)
        self._left_at: dict[str, float] = {}    # tenant -> when its last request left (within the window)

    # ------------------------------------------------------------ counters
    def _tenants(self) -> set[str]:
        return {s.tenant.id for s in self.waiting} | {s.tenant.id for s in self.running}

    def _charge(self, seq: Sequence, tokens: int, token_weight: float) -> None:
        t = seq.tenant
        self.counters[t.id] = self.counters.get(t.id, 0.0) + token_weight * tokens / t.weight

    def charge_extra(self, seq: Sequence, tokens: int) -> None:
        self._charge(seq, tokens, self.cfg.decode_token_weight)

    def add(self, seq: Sequence) -> None:
        t = seq.tenant.id
        backlogged = self._tenants()
        if t not in backlogged:
            floor = min((self.counters.get(u, 0.0) for u in backlogged), default=self._last_left)
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        seq.enqueued_step = self.steps
        super().add(seq)

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        t = seq.tenant.id
        if t not in self._tenants():
            self._last_left = self.counters.get(t, 0.0)
            self._left_at[t] = self.clock()

    def active_tenants(self) -> set[str]:
        """Backlogged tenants, and those whose last request left at most contended_window_s ago."""
        now, window = self.clock(), self.cfg.contended_window_s
        for t in [t for t, at in self._left_at.items() if now - at > window]:
            del self._left_at[t]
        return self._tenants() | set(self._left_at)

    def contended(self) -> bool:
        return len(self.active_tenants()) > 1

    def _contended_cap(self, decodes: int) -> int | None:
        """Prefill tokens for a step with `decodes` decoding sequences while more than one tenant is active;
        None when the contended budget is off or one tenant is active (see the module docstring)."""
        fixed = self.cfg.contended_step_tokens
        if not fixed or not self.contended():
            return None
        ratio = self.cfg.contended_step_ratio
        n = self.step_cost.prefill_within(ratio, decodes) if ratio > 0 and self.step_cost is not None else None
        if n is None:
            return fixed
        return max(min(CONTENDED_MIN_TOKENS, fixed), min(n, self.cfg.max_num_batched_tokens))

    def prefill_per_step(self, decodes: int) -> int:
        """Also the contended cap, while more than one tenant is active."""
        n = super().prefill_per_step(decodes)
        cap = self._contended_cap(decodes)
        return n if cap is None else max(1, min(n, cap))

    def _class(self, seq: Sequence) -> int:
        return max(0, seq.tenant.priority - (self.steps - seq.enqueued_step) // self.cfg.priority_aging_steps)

    def _key(self, seq: Sequence) -> tuple[int, float]:
        return self._class(seq), self.counters.get(seq.tenant.id, 0.0)

    def _order(self, seq: Sequence) -> tuple[int, float, float]:
        """_key; on a tie, the tenant with the fewest running sequences per unit of weight first."""
        return *self._key(seq), self._held(seq.tenant.id) / seq.tenant.weight

    # ------------------------------------------------------------ caps and victims
    def _tenant_pages(self, tenant: str) -> int:
        return sum(len(s.block_table) for s in self.running if s.tenant.id == tenant)

    def _victim(self, seq: Sequence, protected: set[int]) -> Sequence | None:
        best: tuple | None = None
        victim: Sequence | None = None
        for i, s in enumerate(self.running):
            if s is not seq and id(s) in protected:
                continue
            key = (s.tenant.priority, self.counters.get(s.tenant.id, 0.0), s is not seq, i)
            if best is None or key > best:
                best, victim = key, s
        return None if victim is seq else victim

    def _held(self, tenant: str) -> int:
        return sum(1 for s in self.running if s.tenant.id == tenant)

    def _capped(self, seq: Sequence) -> bool:
        """Admitting seq would take its tenant past its running page cap (a tenant with nothing running never is)."""
        cap = seq.tenant.max_running_pages
        held = self._tenant_pages(seq.tenant.id)
        return bool(cap and held and held + self.blocks.pages_needed(seq.num_tokens + 1) > cap)

    def _slot_shares(self) -> dict[str, float]:
        """Each backlogged tenant's share of the batch slots: max_num_seqs * weight / sum of their weights."""
        weights = {s.tenant.id: s.tenant.weight for s in (*self.waiting, *self.running)}
        total = sum(weights.values())
        return {t: self.cfg.max_num_seqs * w / total for t, w in weights.items()}

    def _preempt_for_fairness(self, batch: ScheduledBatch) -> None:
        """All slots held: the first waiting request (class, counter) of a tenant below its slot share takes
        a slot from a tenant that keeps at least its share and has no smaller (class, counter)."""
        if not self.cfg.fair_preemption or len(self.running) < self.cfg.max_num_seqs:
            return
        share = self._slot_shares()
        held = Counter(s.tenant.id for s in self.running)
        under = {s.tenant.id for s in self.waiting if held[s.tenant.id] < share[s.tenant.id]}
        wait = self._next_waiting({s.tenant.id for s in self.waiting} - under)
        while wait is not None and self._capped(wait):
            under.discard(wait.tenant.id)
            wait = self._next_waiting({s.tenant.id for s in self.waiting} - under)
        if wait is None:
            return
        best: tuple | None = None
        victim: Sequence | None = None
        for s in self.running:
            t = s.tenant.id
            key = (s.tenant.priority, self.counters.get(t, 0.0))
            if held[t] - 1 < share[t] or key < self._key(wait) \
                    or s.num_fair_preemptions >= self.cfg.max_fair_preemptions:
                continue
            rank = (*key, -s.num_computed_tokens)
            if best is None or rank > best:
                best, victim = rank, s
        if victim is not None:
            victim.num_fair_preemptions += 1
            self.num_fair_preemptions += 1
            self._preempt(victim, batch)

    def _over_cap(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, protected: set[int]) -> bool:
        """Keep seq's tenant within its page cap for seq to hold num_tokens, preempting the tenant's own newest
        other sequences; True if it cannot be done."""
        cap = seq.tenant.max_running_pages
        if not cap:
            return False
        need = self.blocks.pages_needed(num_tokens) - len(seq.block_table)
        while need > 0 and self._tenant_pages(seq.tenant.id) + need > cap:
            own = [s for s in reversed(self.running)
                   if s is not seq and s.tenant.id == seq.tenant.id and id(s) not in protected]
            if not own:
                return True
            self._preempt(own[0], batch)
        return False

    def _grow(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, protected: set[int]) -> bool:
        if self._over_cap(seq, num_tokens, batch, protected):
            return False
        return super()._grow(seq, num_tokens, batch, protected)

    def _stuck(self, seq: Sequence) -> bool:
        """Also: seq is its tenant's only running sequence at the tenant's page cap."""
        return super()._stuck(seq) or (bool(seq.tenant.max_running_pages) and all(
            s is seq for s in self.running if s.tenant.id == seq.tenant.id))

    # ------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        self.steps += 1
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        wp, wd = self.cfg.prefill_token_weight, self.cfg.decode_token_weight
        self._preempt_for_fairness(batch)
        for seq in sorted((s for s in self.running if not s.is_prefilling), key=self._key):
            if seq not in self.running:      # preempted while making room for another
                continue
            if self._schedule_decode(seq, batch, scheduled):
                self._charge(seq, 1, wd)
                budget -= 1
        cap = self._contended_cap(len(batch.decodes))
        if cap is not None:
            self.contended_cap = cap
            if budget > cap:
                budget = cap        # contended: the prefill share of the step is capped
                self.num_contended_steps += 1
        # prefill chunks and admissions draw on the rest of the budget in (class, counter) order
        pending = [s for s in self.running if s.is_prefilling]
        capped: set[str] = set()
        admitting = True
        share = self._slot_shares()
        shield: tuple[str, tuple[int, float]] | None = None    # the first token this step isolates: tenant, key
        counters = dict(self.counters)                         # as the prefill share of the step starts

        def key0(s: Sequence) -> tuple[int, float]:
            return self._class(s), counters.get(s.tenant.id, 0.0)

        def shut(s: Sequence, admit: int) -> bool:
            """Isolation: s's tenant has a larger key than the shielded one, or is (would go) over its share."""
            if shield is None or s.tenant.id == shield[0]:
                return False
            return key0(s) > shield[1] or self._held(s.tenant.id) + admit > share[s.tenant.id]

        while budget > 0:
            run = min((s for s in pending if not shut(s, 0)), key=self._order, default=None)
            wait = self._next_waiting(capped, lambda s: shut(s, 1)) \
                if admitting and len(self.running) < self.cfg.max_num_seqs else None
            if run is None and wait is None:
                break
            if run is not None and (wait is None or self._order(run) <= self._order(wait)):
                pending.remove(run)
                if run not in self.running:
                    continue
                n = self._schedule_chunk(run, budget, batch, scheduled)
                if not n:
                    continue
            else:
                assert wait is not None
                if self._capped(wait):
                    capped.add(wait.tenant.id)
                    continue
                if not self._admit(wait, budget, batch):
                    admitting = False            # out of pages: nobody jumps the queue past it
                    continue
                self.waiting.remove(wait)
                run = wait
                n = self._add_prefill(wait, min(wait.num_uncomputed, budget), batch, scheduled)
            self._charge(run, n, wp)
            budget -= n
            if shield is None and self.cfg.prefill_isolation and not run.output_ids \
                    and self._held(run.tenant.id) <= share[run.tenant.id]:
                shield = run.tenant.id, key0(run)
        return batch

    def _next_waiting(self, skip: set[str], shut=None) -> Sequence | None:
        """The oldest waiting request of the tenant with the smallest (class, counter), on a tie the tenant with
        the fewest running sequences per unit of weight; tenants in skip and requests shut(s) aside."""
        held = Counter(s.tenant.id for s in self.running)
        best: tuple | None = None
        pick: Sequence | None = None
        for i, s in enumerate(self.waiting):
            if s.tenant.id in skip or (shut is not None and shut(s)):
                continue
            key = (*self._key(s), held[s.tenant.id] / s.tenant.weight, i)     # _order without a scan per request
            if best is None or key < best:
                best, pick = key, s
        return pick


def make_scheduler(cfg: EngineConfig, blocks: BlockManager, step_cost: StepCost | None = None) -> Scheduler:
    return FairScheduler(cfg, blocks, step_cost) if cfg.scheduler == "fair" else Scheduler(cfg, blocks)
