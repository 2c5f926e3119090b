"""Builders shared by the kernel tests: paged caches filled from dense K/V, and dense oracles."""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch

from edgeinfer.kernels.kv_store import kv_store_reference

FP8 = torch.float8_e4m3fn
# EDGEINFER_KERNEL_TEST_DEVICE=cuda runs the same tests compiled on a GPU (no interpreter)
DEVICE = torch.device(os.environ.get("EDGEINFER_KERNEL_TEST_DEVICE", "cpu"))


def on_device(fn):
    """Run a launcher on DEVICE with CPU-built arguments; in-place results are copied back."""
    if DEVICE.type == "cpu":
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        moved = {}

        def move(x):
            if isinstance(x, torch.Tensor):
                moved[id(x)] = (x, x.to(DEVICE))
                return moved[id(x)][1]
            return x

        result = fn(*[move(a) for a in args], **{k: move(v) for k, v in kwargs.items()})
        for cpu, dev in moved.values():
            cpu.copy_(dev.cpu())
        return result.cpu() if isinstance(result, torch.Tensor) else result

    return wrapper


class PagedKV(NamedTuple):
    k_cache: torch.Tensor  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_pages, page_size, kv_heads]
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor  # [B, max_pages] int32
    context_lens: torch.Tensor  # [B] int32
    dense_k: list[torch.Tensor]  # per sequence [n, kv_heads, head_dim] as stored (dequantized for fp8)
    dense_v: list[torch.Tensor]


def build_paged_kv(context_lens, kv_heads, head_dim, page_size, dtype, cache_dtype, spare_pages=3) -> PagedKV:
    """Scatter random K/V of each sequence over shuffled pages; padding table entries hold junk."""
    lens = list(context_lens)
    pages_per_seq = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(pages_per_seq) + spare_pages
    max_pages = max(pages_per_seq + [1]) + 1
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape).to(cache_dtype)  # junk in unused slots must never be read
    v_cache = torch.randn(shape).to(cache_dtype)
    quant = cache_dtype in (FP8, torch.int8)
    k_scale = torch.rand(shape[:3]) * 100 if quant else None
    v_scale = torch.rand(shape[:3]) * 100 if quant else None
    perm = torch.randperm(num_pages)
    tables = torch.randint(-5, 10**6, (len(lens), max_pages), dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for b, n in enumerate(lens):
        pages = perm[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        tables[b, : len(pages)] = pages.int()
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()[:n].long()
        key = torch.randn(n, kv_heads, head_dim, dtype=dtype)
        value = torch.randn(n, kv_heads, head_dim, dtype=dtype)
        kv_store_reference(key, value, k_cache, v_cache, slots, k_scale, v_scale)
        pg, off = slots // page_size, slots % page_size
        if quant:
            dense_k.append(k_cache[pg, off].float() * k_scale[pg, off][..., None])
            dense_v.append(v_cache[pg, off].float() * v_scale[pg, off][..., None])
        else:
            dense_k.append(key.float())
            dense_v.append(value.float())
    return PagedKV(k_cache, v_cache, k_scale, v_scale, tables, torch.tensor(lens, dtype=torch.int32),
                   dense_k, dense_v)


def naive_attention(q, k, v, sm_scale):
    """Dense causal oracle: q [Lq, heads, D] are the last Lq positions of k/v [Lk, kv_heads, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    lq, lk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    future = torch.arange(lk)[None, :] > torch.arange(lk - lq, lk)[:, None]
    scores = scores.masked_fill(future[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
