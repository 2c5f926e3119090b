"""A request inside the engine: tokens, pages, sampling state, output channel."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING, Protocol

from edgeinfer.protocol.page_id import PageKeyContext, hash_page, page_hashes
from edgeinfer.protocol.wire import SamplingParams, TenantSpec

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher

    from edgeinfer.backend.engine.spec.state import SpecState
    from edgeinfer.backend.engine.stop import StopChecker


_serials = itertools.count(1)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class EmitFn(Protocol):
    """seq.emit(seq, token_ids, logprobs, text, finish_reason[, error, error_code])"""

    def __call__(self, seq: Sequence, ids: list[int], lps: list | None, text: str, reason: str | None,
                 error: str | None = None, error_code: int = 500) -> None: ...


class Sequence:
    max_new_tokens: int                     # set by the engine

    def __init__(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, key_ctx: PageKeyContext,
                 emit: EmitFn, tenant: TenantSpec | None = None) -> None:
        self.request_id = request_id
        self.tenant = tenant or TenantSpec(key_ctx.namespace)   # who it is for (fair scheduling, quotas)
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.sampling = sampling
        self.key_ctx = key_ctx
        self.emit = emit
        self.status = SeqStatus.WAITING
        self.serial = next(_serials)          # owner of the pages it takes (backend/engine/kv_integrity.py)
        self.block_table: list[int] = []
        self.page_stamps: list[int] = []      # the stamp of each block_table page when taken (0: not held)
        self.table_row = -1                 # its row in the BlockManager's BlockTables while it holds pages
        self.num_computed_tokens = 0        # tokens whose KV is in the cache
        self.num_cached_prompt_tokens = 0   # prompt tokens served from the prefix cache (first admission)
        self.page_hashes: list[bytes] = []  # hashes of the full pages so far
        self.finish_reason: str | None = None
        self.arrival = time.monotonic()
        self.admitted_at: float | None = None                # first admission (queue time = admitted_at - arrival)
        self.enqueued_step = 0                              # scheduler step when it last joined the waiting queue
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_preemptions = 0
        self.num_fair_preemptions = 0                       # of those, preempted to admit an under-share tenant
        self.admitted_once = False
        self.generator: torch.Generator | None = None       # for seeded sampling
        self.stop_checker: StopChecker | None = None        # set by the engine (stop strings, detokenizer)
        self.matcher: LLMatcher | None = None               # grammar state of a constrained request
        self.grammar_over_budget = 0                         # steps whose grammar work took over the budget
        # SamplingParams.prompt_logprobs: one entry per prompt token computed so far (the first None); sent whole
        # with the first chunk (then None)
        self.prompt_lps: list | None = [None] if sampling.prompt_logprobs is not None else None
        self.spec: SpecState | None = None                  # once it has drafted (backend/engine/spec/)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1

    def extend_hashes(self, pending: list[int] | None = None) -> list[bytes]:
        """Hash newly full pages (of computed tokens); returns the new hashes. `pending`: tokens whose KV is computed
        but which are not appended yet (a verify step's accepted draft tokens, appended after the pages are
        sealed)."""
        p = self.key_ctx.page_size
        if (len(self.page_hashes) + 1) * p > self.num_computed_tokens:
            return []
        ids = self.all_ids + pending if pending else self.all_ids
        new = []
        while (len(self.page_hashes) + 1) * p <= self.num_computed_tokens:
            i = len(self.page_hashes)
            parent = self.page_hashes[-1] if self.page_hashes else self.key_ctx.root
            h = hash_page(parent, ids[i * p:(i + 1) * p])
            self.page_hashes.append(h)
            new.append(h)
        return new

    def prompt_page_hashes(self) -> list[bytes]:
        return page_hashes(self.key_ctx, self.all_ids)
