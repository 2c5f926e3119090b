"""The MTP draft layer's runner (speculative 'mtp', backend/model/mtp.py): its own KV layer over the engine's
pages (allocated by ModelRunner in the same budget), the rows of the last step it drafts from, the draft step, and
the clearing of its rows on pages written from outside the pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgeinfer.backend.engine.block_table import BlockTables
from edgeinfer.backend.engine.scheduler import ScheduledBatch
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV

if TYPE_CHECKING:
    from edgeinfer.backend.model.paged import PagedModel


class MTPRunner:
    def __init__(self, model: PagedModel, kv: LayerKV, tables: BlockTables, page_size: int) -> None:
        self.model, self.kv, self.tables, self.page_size = model, kv, tables, page_size
        self.step_hidden: torch.Tensor | None = None   # the last step's hidden states, every row
        self.step_rows: dict[int, tuple[int, int, int]] = {}   # id(seq) -> (first row, first position, rows)

    def keep_rows(self, batch: ScheduledBatch, hidden: torch.Tensor, cu: list[int], nd0: int, nd: int
                  ) -> dict[int, tuple[int, int, int]]:
        """Where each sequence's rows of this step are in `hidden` (before num_computed_tokens advances)."""
        self.step_hidden = hidden
        rows = self.step_rows = {}
        for i, s in enumerate(batch.decodes):
            rows[id(s)] = (i, s.num_computed_tokens, 1)
        at = nd0
        for s, d in batch.verifies:
            rows[id(s)] = (at, s.num_computed_tokens, len(d) + 1)
            at += len(d) + 1
        for j, (s, n) in enumerate(batch.prefills):
            rows[id(s)] = (nd + cu[j], s.num_computed_tokens, n)
        return rows

    def step(self, items: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run the MTP layer over the rows the last step computed for each (sequence, rows) item (rows: how many of
        its step rows count, from the first: a verify's accepted ones), pairing the hidden state at position i with
        the token at i + 1 (the sequence's ids must reach it); store its KV there. Returns the MTP logits at each
        item's last row [len(items), vocab] (a draft for the token after the sequence's last)."""
        assert self.model.mtp is not None and self.step_hidden is not None
        p, dev = self.page_size, self.model.device
        rows: list[int] = []
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        cu = [0]
        for s, n in items:
            r0, p0, _ = self.step_rows[id(s)]
            rows += range(r0, r0 + n)
            ids += s.all_ids[p0 + 1:p0 + n + 1]
            pos += range(p0, p0 + n)
            slots += [s.block_table[j // p] * p + j % p for j in range(p0, p0 + n)]
            cu.append(cu[-1] + n)
        seqs = [s for s, _ in items]
        width = max(-(-(self.step_rows[id(s)][1] + n) // p) for s, n in items)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), num_decode=0,
            decode_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            prefill_block_tables=torch.from_numpy(self.tables.gather(seqs, width)).to(dev),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor([self.step_rows[id(s)][1] + n for s, n in items], dtype=torch.int32,
                                              device=dev),
            prefill_max_seqlen_q=max(n for _, n in items))
        hidden = self.step_hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev))
        with torch.inference_mode():
            y = self.model.mtp(self.model, torch.tensor(ids, dtype=torch.long, device=dev),
                               torch.tensor(pos, dtype=torch.long, device=dev), hidden, self.kv, meta)
            last = torch.tensor([c - 1 for c in cu[1:]], dtype=torch.long, device=dev)
            return self.model.mtp.logits(self.model, y.index_select(0, last)).cpu()

    def clear(self, pages: list[int]) -> None:
        """Zero the MTP rows of pages written from outside the pool (their bodies carry the main layers only)."""
        if not pages:
            return
        idx = torch.tensor(pages, dtype=torch.long, device=self.kv.k.device)
        for t in (self.kv.k, self.kv.v):
            if t is not None:
                t.view(torch.uint8).index_fill_(0, idx, 0)
