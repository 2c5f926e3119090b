"""How long a new request would wait for its first token: the prompt tokens queued ahead of it over the rate
at which this engine prefills them (measured).

The engine thread publishes, after every step, the tokens still to prefill (waiting requests and the unfinished
prompts of running ones) and how many running sequences decode; the event loop adds the prompts submitted since
(`submitted` - `handled`: each counter is written by one thread). The rate is a moving average of tokens per
second over steps at least half full (a step's time is mostly its tokens; tiny steps would understate the rate),
after the first `warmup_steps` of them (the first forward passes pay one-off costs: page faults on the weights,
kernel set-up; one such step alone would set the rate too low).
Each step spends one token of its budget per decoding sequence, so prefill gets `budget - decoding` of it.

While the fair scheduler caps contended steps (backend.engine.fair) a step computes fewer prefill tokens than
that, and the rate of full steps would make the estimate optimistic (the 503 bound let through requests it
holds longer): then, once the engine's step-cost fit exists (backend.engine.step_cost), the wait is the steps
the queued tokens need at the capped size, each of its predicted time.

Not counted: a wait for a free sequence slot (max_num_seqs), prefix-cache hits (they make the estimate high).
"""

from __future__ import annotations

import math

from edgeinfer.backend.engine.step_cost import StepCost


class Backlog:
    def __init__(self, budget_tokens: int, alpha: float = 0.3, warmup_steps: int = 2,
                 step_cost: StepCost | None = None) -> None:
        self.budget = budget_tokens
        self.step_cost = step_cost
        self.alpha = alpha
        self.warmup_steps = warmup_steps    # full steps not measured
        self.tok_s: float | None = None     # measured tokens per second of full steps; None until one ran
        self.queued_tokens = 0              # to prefill, at the end of the last step (engine thread)
        self.decoding = 0                   # running sequences past their prompt (engine thread)
        self.per_step = budget_tokens       # prefill tokens a step computes now (engine thread)
        self.submitted = 0                  # prompt tokens handed to the engine (event loop)
        self.handled = 0                    # prompt tokens the engine thread has put in its scheduler

    def on_step(self, scheduler, batch_tokens: int, dt: float) -> None:
        if dt > 0 and batch_tokens * 2 >= self.budget and self.warmup_steps > 0:
            self.warmup_steps -= 1
        elif dt > 0 and batch_tokens * 2 >= self.budget:
            rate = batch_tokens / dt
            self.tok_s = rate if self.tok_s is None else self.tok_s + self.alpha * (rate - self.tok_s)
        self.observe(scheduler)

    def observe(self, scheduler) -> None:
        """Publish what the scheduler still has to prefill (engine thread: after a step, or when it went idle)."""
        queued = sum(s.num_uncomputed for s in scheduler.waiting)
        decoding = 0
        for s in scheduler.running:
            if s.is_prefilling:
                queued += s.num_uncomputed
            else:
                decoding += 1
        self.queued_tokens, self.decoding = queued, decoding
        self.per_step = scheduler.prefill_per_step(decoding)

    def wait_s(self, prompt_tokens: int) -> float | None:
        """Estimated seconds until a request of `prompt_tokens` has its first token; None before any measure."""
        if self.per_step < self.budget - self.decoding and self.step_cost is not None:
            dt = self.step_cost.predict(self.decoding, self.per_step)       # a capped step
            if dt is not None and dt > 0:
                return self._ahead(prompt_tokens) / self.per_step * dt
        return self.full_step_wait_s(prompt_tokens)

    def full_step_wait_s(self, prompt_tokens: int) -> float | None:
        """The estimate from the measured rate of full steps (all of it when steps are not capped)."""
        if self.tok_s is None:
            return None
        prefill_share = max(1, self.budget - self.decoding) / self.budget
        return self._ahead(prompt_tokens) / (self.tok_s * prefill_share)

    def queued(self) -> int:
        """Prompt tokens waiting to be prefilled (queued in the scheduler or handed to it): what a token-aware router
        weighs a prefill node by."""
        return self._ahead(0)

    def _ahead(self, prompt_tokens: int) -> int:
        return self.queued_tokens + max(0, self.submitted - self.handled) + prompt_tokens

    def retry_after_s(self, prompt_tokens: int, bound_s: float) -> int:
        """Whole seconds until the estimated wait drops to `bound_s` (at least 1)."""
        wait = self.wait_s(prompt_tokens) or 0.0
        return max(1, math.ceil(wait - bound_s))
