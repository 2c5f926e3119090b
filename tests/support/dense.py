"""Drive the paged model directly for one sequence (prefill then greedy decode) — a test helper."""

from __future__ import annotations

import torch

from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV
from edgeinfer.backend.model.decoder import DecoderModel


def fresh_kv(model: DecoderModel, num_pages: int, page_size: int = 16) -> list[LayerKV]:
    c = model.cfg
    shape = (num_pages, page_size, c.num_kv_heads, c.head_dim)
    dev = model.device
    return [LayerKV(torch.zeros(shape, dtype=model.dtype, device=dev), torch.zeros(shape, dtype=model.dtype, device=dev))
            for _ in range(c.num_layers)]


def _none_tables(width: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((0, width), dtype=torch.int32, device=dev), torch.zeros(0, dtype=torch.int32, device=dev)


def prefill_logits(model: DecoderModel, ids: list[int], kv: list[LayerKV], page_size: int = 16) -> torch.Tensor:
    """Tensors on the model's device (CUDA runs the Triton kernels); logits returned on the host."""
    n, dev = len(ids), model.device
    width = kv[0].k.shape[0]
    table = torch.randperm(width, generator=torch.Generator().manual_seed(1)).to(torch.int32)[None]
    slots = torch.tensor([int(table[0, i // page_size]) * page_size + i % page_size for i in range(n)])
    dt, dc = _none_tables(width, dev)
    meta = AttentionMetadata(slots.to(dev), 0, dt, dc, table.to(dev), torch.tensor([0, n], dtype=torch.int32, device=dev),
                             torch.tensor([n], dtype=torch.int32, device=dev))
    prefill_logits.table = table
    return model.compute_logits(model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), kv, meta)).cpu()


def greedy(model: DecoderModel, ids: list[int], steps: int, num_pages: int = 64, page_size: int = 16) -> tuple[
        torch.Tensor, list[int]]:
    kv = fresh_kv(model, num_pages, page_size)
    logits = prefill_logits(model, ids, kv, page_size)
    table = prefill_logits.table
    out = [int(logits[-1].argmax())]
    pos = len(ids)
    for _ in range(steps - 1):
        dev = model.device
        slot = torch.tensor([int(table[0, pos // page_size]) * page_size + pos % page_size], device=dev)
        meta = AttentionMetadata(slot, 1, table.to(dev), torch.tensor([pos + 1], dtype=torch.int32, device=dev),
                                 torch.zeros((0, table.shape[1]), dtype=torch.int32, device=dev),
                                 torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(0, dtype=torch.int32, device=dev))
        h = model(torch.tensor([out[-1]], device=dev), torch.tensor([pos], device=dev), kv, meta)
        out.append(int(model.compute_logits(h)[-1].argmax()))
        pos += 1
    return logits, out


def decode_batch(model: DecoderModel, batch: int, context: int, page_size: int = 16
                 ) -> tuple[list[LayerKV], torch.Tensor, AttentionMetadata]:
    """A decode step of `batch` sequences at `context` tokens of context each (their own pages, the new token at
    position `context`) -> (a fresh pool, positions [batch], metadata); the benchmarks time steps on it."""
    width = -(-(context + 1) // page_size)
    kv = fresh_kv(model, batch * width + 1, page_size)
    tables = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
    meta = AttentionMetadata(tables[:, context // page_size].long() * page_size + context % page_size, batch, tables,
                             torch.full((batch,), context + 1, dtype=torch.int32),
                             torch.zeros((0, width), dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                             torch.zeros(0, dtype=torch.int32))
    return kv, torch.full((batch,), context), meta


def prefill_batch(model: DecoderModel, n: int, page_size: int = 16) -> tuple[list[LayerKV], AttentionMetadata]:
    """One sequence's prefill of n tokens on pages 0.. of a fresh pool -> (pool, metadata)."""
    width = -(-n // page_size)
    meta = AttentionMetadata(torch.arange(n), 0, torch.zeros((0, width), dtype=torch.int32),
                             torch.zeros(0, dtype=torch.int32), torch.arange(width, dtype=torch.int32)[None],
                             torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), n)
    return fresh_kv(model, width, page_size), meta
