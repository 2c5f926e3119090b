"""Turns a scheduled batch into model inputs over the paged KV pool; owns the pool."""

from __future__ import annotations

import torch

from backend.engine.config import EngineConfig
from backend.engine.scheduler import ScheduledBatch
from backend.engine.sequence import Sequence
from backend.model.llama import AttentionMetadata, LayerKV, LlamaModel

SCALE_DTYPE = torch.bfloat16   # fp8 scales: 2 bytes per token-head (float32 would make fp8 only 1.88x of bf16)


def kv_bytes_per_token(model: LlamaModel, kv_dtype: torch.dtype) -> int:
    c = model.cfg
    elt = torch.empty((), dtype=kv_dtype).element_size()
    scale = SCALE_DTYPE.itemsize if kv_dtype == torch.float8_e4m3fn else 0   # one bf16 scale per token-head
    return 2 * c.num_layers * c.num_kv_heads * (c.head_dim * elt + scale)


class ModelRunner:
    def __init__(self, model: LlamaModel, cfg: EngineConfig) -> None:
        self.model = model
        self.cfg = cfg
        c = model.cfg
        self.kv_dtype = cfg.resolve_kv_dtype(model.dtype)
        self.bytes_per_token = kv_bytes_per_token(model, self.kv_dtype)
        self.page_bytes = self.bytes_per_token * cfg.page_size
        self.num_pages = cfg.num_pages or max(1, cfg.kv_cache_bytes // self.page_bytes)
        shape = (self.num_pages, cfg.page_size, c.num_kv_heads, c.head_dim)
        dev = model.device
        fp8 = self.kv_dtype == torch.float8_e4m3fn
        self.kv: list[LayerKV] = []
        for _ in range(c.num_layers):
            self.kv.append(LayerKV(
                torch.zeros(shape, dtype=self.kv_dtype, device=dev), torch.zeros(shape, dtype=self.kv_dtype, device=dev),
                torch.ones(shape[:3], dtype=SCALE_DTYPE, device=dev) if fp8 else None,
                torch.ones(shape[:3], dtype=SCALE_DTYPE, device=dev) if fp8 else None))

    def _table(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max((len(s.block_table) for s in seqs), default=0)
        t = torch.zeros((len(seqs), max(width, 1)), dtype=torch.int32)
        for i, s in enumerate(seqs):
            t[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        return t

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step; returns the sequences that need a new token and their logits [n, vocab]."""
        p = self.cfg.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in batch.decodes:
            i = s.num_computed_tokens
            ids.append(s.all_ids[i])
            pos.append(i)
            slots.append(s.block_table[i // p] * p + i % p)
        cu = [0]
        pre_ctx: list[int] = []
        for s, n in batch.prefills:
            start = s.num_computed_tokens
            all_ids = s.all_ids
            ids.extend(all_ids[start:start + n])
            r = range(start, start + n)
            pos.extend(r)
            bt = s.block_table
            slots.extend(bt[i // p] * p + i % p for i in r)
            cu.append(cu[-1] + n)
            pre_ctx.append(start + n)
        dev = self.model.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode=len(batch.decodes),
            decode_block_tables=self._table(batch.decodes).to(dev),
            decode_context_lens=torch.tensor([s.num_computed_tokens + 1 for s in batch.decodes], dtype=torch.int32,
                                             device=dev),
            prefill_block_tables=self._table([s for s, _ in batch.prefills]).to(dev),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(pre_ctx, dtype=torch.int32, device=dev),
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, device=dev),
                            self.kv, meta)
        rows: list[int] = list(range(len(batch.decodes)))
        need: list[Sequence] = list(batch.decodes)
        nd = len(batch.decodes)
        for j, (s, n) in enumerate(batch.prefills):
            if s.num_computed_tokens + n == s.num_tokens:
                rows.append(nd + cu[j + 1] - 1)
                need.append(s)
        for s in batch.decodes:
            s.num_computed_tokens += 1
        for s, n in batch.prefills:
            s.num_computed_tokens += n
        if not need:
            return [], torch.empty(0)
        if len(rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(rows, device=dev))
        return need, self.model.compute_logits(hidden).cpu()

    # ---- page movement (for the page store)
    def read_page(self, page: int) -> list[torch.Tensor]:
        """All layers' K/V (and scales) of one page, on the host."""
        out = []
        for kv in self.kv:
            out += [kv.k[page].cpu(), kv.v[page].cpu()]
            if kv.k_scale is not None:
                assert kv.v_scale is not None   # both scales are allocated together (fp8 caches)
                out += [kv.k_scale[page].cpu(), kv.v_scale[page].cpu()]
        return out

    def write_page(self, page: int, parts: list[torch.Tensor]) -> None:
        it = iter(parts)
        for kv in self.kv:
            kv.k[page].copy_(next(it))
            kv.v[page].copy_(next(it))
            if kv.k_scale is not None:
                assert kv.v_scale is not None   # both scales are allocated together (fp8 caches)
                kv.k_scale[page].copy_(next(it))
                kv.v_scale[page].copy_(next(it))
