"""Turns a scheduled batch into model inputs over the paged KV pool; owns the pool."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from edgeinfer.backend.engine.block_table import BlockTables
from edgeinfer.backend.engine.cuda_graphs import decode_graphs_for
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.kv_pool import KVFormat, allocate_pool
from edgeinfer.backend.engine.scheduler import ScheduledBatch
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.backend.engine.spec.mtp import MTPRunner
from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV
from edgeinfer.backend.model.paged import PagedModel


@dataclasses.dataclass
class RunnerOutput:
    """What one step computed, for the engine to act on."""
    seqs: list[Sequence]                                 # the sequences that need a new token
    logits: torch.Tensor                                 # [len(seqs), vocab], on the CPU
    verify_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)   # one per batch.verifies entry:
    #                                                      a row per verified position (its num_computed_tokens is left
    #                                                      for the engine to advance by what it accepts)
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = dataclasses.field(default_factory=list)
    #                                                      (seq, first position, [n, vocab]): prompt logprobs' rows
    step_rows: dict[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    #                                                      MTP only: id(seq) -> (first row, first position, rows)


class ModelRunner:
    def __init__(self, model: PagedModel, cfg: EngineConfig) -> None:
        self.model = model
        self.cfg = cfg
        c = model.cfg
        self.kv_format = KVFormat.resolve(cfg.kv_dtype, model.dtype, latent=c.mla is not None, head_dim=c.head_dim)
        self.bytes_per_token = self.kv_format.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim)
        self.page_bytes = self.bytes_per_token * cfg.page_size
        # the MTP layer's KV (speculative 'mtp'): one more layer over the same pages, in the same budget
        mtp_bytes = self.kv_format.bytes_per_token(1, c.num_kv_heads, c.head_dim) if model.mtp is not None else 0
        per_page = self.page_bytes + mtp_bytes * cfg.page_size
        if cfg.num_pages is None and cfg.kv_cache_bytes < per_page:
            raise ValueError(f"--kv-cache-bytes {cfg.kv_cache_bytes} holds no KV page: one page of {cfg.page_size} "
                             f"tokens is {per_page} bytes in {self.kv_format.ident}")
        self.num_pages = cfg.num_pages or cfg.kv_cache_bytes // per_page
        self.kv: list[LayerKV] = allocate_pool(self.kv_format, self.num_pages, cfg.page_size, c, model.device)
        self.page_io = model.page_io(self.kv)   # page bodies in and out (a tensor-parallel node's span its ranks)
        max_len = min(cfg.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        self.tables = BlockTables(cfg.max_num_seqs, -(-max_len // cfg.page_size))   # kept by the BlockManager
        self.mtp: MTPRunner | None = None   # the MTP layer and its KV (speculative 'mtp'): backend/engine/spec/mtp.py
        if model.mtp is not None:
            one = dataclasses.replace(c, num_layers=1)
            mtp_kv = allocate_pool(self.kv_format, self.num_pages, cfg.page_size, one, model.device)[0]
            self.mtp = MTPRunner(model, mtp_kv, self.tables, cfg.page_size)
        self._stage = np.zeros((4, cfg.max_num_batched_tokens + cfg.max_num_seqs), dtype=np.int64)   # reused
        self.graphs = decode_graphs_for(model, self.kv, cfg.cuda_graphs, cfg.max_num_seqs, self.tables.array.shape[1])

    def _inputs(self, batch: ScheduledBatch) -> tuple[np.ndarray, list[int], np.ndarray, np.ndarray]:
        """-> staging rows [ids, positions, slots, decode context lens] over the step's tokens (views of one
        reused buffer), prefill cu_seqlens, and the decode/prefill block tables gathered from `tables`.
        The decode rows are the decoding sequences' last tokens, then each verify chunk's k+1 tokens as k+1 decode
        rows of that sequence (row j at position n-1+j attends to the context up to and including itself: the KV
        of every row is stored before attention), so a step with drafts keeps the decode path."""
        p = self.cfg.page_size
        dseqs, dpos, dids = self.decode_rows(batch)
        nd = len(dseqs)
        t = nd + sum(n for _, n in batch.prefills)
        if t > self._stage.shape[1]:
            self._stage = np.zeros((4, max(t, 2 * self._stage.shape[1])), dtype=np.int64)
        ids, pos, slots, ctx = self._stage[:, :t]
        if nd:
            ids[:nd] = dids
            pos[:nd] = dpos
            slots[:nd] = [s.block_table[j // p] * p + j % p for s, j in zip(dseqs, dpos)]
            ctx[:nd] = pos[:nd] + 1
        cu = [0]
        for s, n in batch.prefills:
            start, lo = s.num_computed_tokens, nd + cu[-1]
            ids[lo:lo + n] = s.all_ids[start:start + n]
            r = np.arange(start, start + n)
            pos[lo:lo + n] = r
            slots[lo:lo + n] = np.asarray(s.block_table, dtype=np.int64)[r // p] * p + r % p
            cu.append(cu[-1] + n)
        dec_width = -(-int(ctx[:nd].max()) // p) if nd else 0
        pre_width = max((len(s.block_table) for s, _ in batch.prefills), default=0)
        return (self._stage[:, :t], cu, self.tables.gather(dseqs, dec_width),
                self.tables.gather([s for s, _ in batch.prefills], pre_width))

    @staticmethod
    def decode_rows(batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[int]]:
        """(sequence, position, token) of every decode row: one per decoding sequence, then k+1 per verify chunk
        (the last token and the draft: backend/engine/spec/)."""
        seqs = list(batch.decodes)
        pos = [s.num_computed_tokens for s in batch.decodes]
        ids = [s.last_token_id for s in batch.decodes]
        for s, draft in batch.verifies:
            n = s.num_computed_tokens
            seqs += [s] * (len(draft) + 1)
            pos += range(n, n + len(draft) + 1)
            ids += [s.last_token_id, *draft]
        return seqs, pos, ids

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run one step -> RunnerOutput: the sequences that need a new token and their logits, each verify chunk's
        logits, the prompt-logprob rows.
        Block tables come from self.tables, which the BlockManager keeps in step with every seq.block_table."""
        stage, cu, dec_tables, pre_tables = self._inputs(batch)
        nd0 = len(batch.decodes)                 # decode rows of decoding sequences; verify rows follow them
        nd = nd0 + sum(len(d) + 1 for _, d in batch.verifies)
        out = RunnerOutput([], torch.empty(0))
        if self.graphs is not None and not batch.prefills and not batch.verifies and self.mtp is None:
            logits = self.graphs.run(stage, dec_tables)
            if logits is not None:
                for s in batch.decodes:
                    s.num_computed_tokens += 1
                out.seqs, out.logits = list(batch.decodes), logits.cpu()
                return out
        dev = self.model.device

        def to_dev(a) -> torch.Tensor:   # no stream sync: pageable H2D copies are staged at once
            t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a))
            return t if dev.type == "cpu" else t.to(dev, non_blocking=True)

        ids, pos, slots, ctx = to_dev(stage)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode=nd,
            decode_block_tables=to_dev(dec_tables),
            decode_context_lens=ctx[:nd].to(torch.int32),
            prefill_block_tables=to_dev(pre_tables),
            prefill_cu_seqlens_q=to_dev(np.asarray(cu, dtype=np.int32)),
            prefill_context_lens=to_dev(np.asarray([s.num_computed_tokens + n for s, n in batch.prefills],
                                                   dtype=np.int32)),
            prefill_max_seqlen_q=max((n for _, n in batch.prefills), default=0),
        )
        rows: list[int] = list(range(nd0))
        need: list[Sequence] = list(batch.decodes)
        for j, (s, n) in enumerate(batch.prefills):
            if s.num_computed_tokens + n == s.num_tokens:
                rows.append(nd + cu[j + 1] - 1)
                need.append(s)
        rows += range(nd0, nd)
        # prompt logprobs: the logits at each prompt position of the chunk that predict the next prompt token
        wanted: list[tuple[Sequence, int, int]] = []     # (seq, first position, rows)
        for j, (s, n) in enumerate(batch.prefills):
            if s.prompt_lps is not None:
                start = s.num_computed_tokens
                last = min(start + n, len(s.prompt_ids) - 1)       # positions whose next token is a prompt token
                if last > start and len(s.prompt_lps) < last + 1:
                    wanted.append((s, start, last - start))
                    rows += range(nd + cu[j], nd + cu[j] + last - start)
        hidden = self.model(ids, pos, self.kv, meta)
        if self.mtp is not None:
            out.step_rows = self.mtp.keep_rows(batch, hidden, cu, nd0, nd)
        for s in batch.decodes:
            s.num_computed_tokens += 1
        for s, n in batch.prefills:
            s.num_computed_tokens += n
        if not rows:
            return out
        if len(rows) < hidden.shape[0] or rows != list(range(len(rows))):
            hidden = hidden.index_select(0, to_dev(np.asarray(rows, dtype=np.int64)))
        logits = self.model.compute_logits(hidden).cpu()
        at = len(need)
        for _, d in batch.verifies:
            out.verify_logits.append(logits[at:at + len(d) + 1])
            at += len(d) + 1
        for s, start, count in wanted:
            out.prompt_logits.append((s, start, logits[at:at + count]))
            at += count
        out.seqs, out.logits = need, logits[:len(need)]
        return out

    # ---- page movement (for the page store)
    def read_page(self, page: int) -> list[torch.Tensor]:
        """All layers' K/V (and scales) of one page, on the host."""
        out = []
        for kv in self.kv:   # k, v, then the fp8 scales (an MLA pool: the latent and its scale only)
            out += [t[page].cpu() for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]
        return out
