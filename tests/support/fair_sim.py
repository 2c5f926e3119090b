"""Drive a scheduler + the real BlockManager without a model: each scheduled token is "computed" as the
ModelRunner would (num_computed_tokens advances; a finished prefill or a decode appends one token).
For unit tests of scheduling policy; the engine-level tests run the real model."""

from __future__ import annotations

import itertools
from collections import Counter

from edgeinfer.backend.engine.block_manager import BlockManager
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.fair import make_scheduler
from edgeinfer.backend.engine.scheduler import Scheduler
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.protocol.page_id import PageKeyContext
from edgeinfer.protocol.wire import SamplingParams, TenantSpec

_ids = itertools.count()


def ctx(namespace: str, page_size: int = 16) -> PageKeyContext:
    return PageKeyContext(b"seed", namespace, "fp", "fp32", page_size)


def seq(tenant: TenantSpec, prompt_len: int = 16, max_new: int = 8, first_token: int = 1) -> Sequence:
    s = Sequence(f"{tenant.id}-{next(_ids)}", list(range(first_token, first_token + prompt_len)),
                 SamplingParams(max_tokens=max_new), ctx(f"tenant:{tenant.id}"), lambda *a, **k: None, tenant)
    s.max_new_tokens = max_new
    return s


class Sim:
    def __init__(self, num_pages: int = 256, **cfg) -> None:
        self.cfg = EngineConfig(num_pages=num_pages, **cfg)
        self.blocks = BlockManager(num_pages, self.cfg.page_size, self.cfg.enable_prefix_cache)
        self.sched: Scheduler = make_scheduler(self.cfg, self.blocks)
        self.served: Counter[str] = Counter()       # tokens scheduled per tenant (prefill + decode)
        self.finished: list[Sequence] = []
        self.admitted: list[str] = []               # request ids in order of first admission

    def add(self, s: Sequence) -> Sequence:
        self.sched.add(s)
        return s

    def step(self):
        batch = self.sched.schedule()
        for s in batch.out_of_room:
            self.sched.remove(s)
            s.finish_reason = "length"
            self.finished.append(s)
        for s, _n in batch.prefills:
            if s.request_id not in self.admitted:
                self.admitted.append(s.request_id)
        for s in batch.decodes:
            self.served[s.tenant.id] += 1
            s.num_computed_tokens += 1
            s.output_ids.append(7)
        for s, n in batch.prefills:
            self.served[s.tenant.id] += n
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.output_ids.append(7)
        for s in [*batch.decodes, *(p for p, _ in batch.prefills)]:
            s.extend_hashes()
            if len(s.output_ids) >= s.max_new_tokens and s in self.sched.running:
                self.sched.remove(s)
                s.finish_reason = "length"
                self.finished.append(s)
        return batch
