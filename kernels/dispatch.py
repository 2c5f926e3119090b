"""Placeholder dispatcher (references only) until the Triton kernels land; same public names."""

from __future__ import annotations

import torch


def kv_store(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    # key/value: [T, kv_heads, head_dim]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_pages, page_size = k_cache.shape[:2]
    pages, offs = slots // page_size, slots % page_size
    if k_cache.dtype == torch.float8_e4m3fn:
        for src, cache, scale in ((key[keep], k_cache, k_scale), (value[keep], v_cache, v_scale)):
            s = src.float().abs().amax(-1).clamp(min=1e-8) / 448.0
            cache[pages, offs] = (src.float() / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale[pages, offs] = s
    else:
        k_cache[pages, offs] = key[keep].to(k_cache.dtype)
        v_cache[pages, offs] = value[keep].to(v_cache.dtype)


def _gather(cache, scale, table, n, dtype):
    page_size = cache.shape[1]
    pages = table[: (n + page_size - 1) // page_size].long()
    x = cache[pages].reshape(-1, *cache.shape[2:])[:n]
    if scale is not None:
        x = x.float() * scale[pages].reshape(-1, scale.shape[2])[:n, :, None]
    return x.to(dtype)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sm_scale,
                            k_scale=None, v_scale=None):
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    for b in range(block_tables.shape[0]):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(context_lens[b])
        if e == s:
            continue
        k = _gather(k_cache, k_scale, block_tables[b], n, torch.float32)
        v = _gather(v_cache, v_scale, block_tables[b], n, torch.float32)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        qb = q[s:e].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale
        qpos = torch.arange(n - (e - s), n)[:, None]
        mask = torch.arange(n)[None, :] > qpos
        scores.masked_fill_(mask[None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, sm_scale, k_scale=None, v_scale=None):
    b = q.shape[0]
    cu = torch.arange(b + 1, dtype=torch.int32)
    return paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, context_lens, sm_scale, k_scale, v_scale)


def w4a16_gemm(x, qweight, scales, zeros=None, group_size=128):
    n, k2 = qweight.shape
    q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(n, k2 * 2).float()
    z = zeros.float() if zeros is not None else torch.full_like(scales, 8.0, dtype=torch.float32)
    w = (q - z.repeat_interleave(group_size, 1)) * scales.float().repeat_interleave(group_size, 1)
    return (x.float() @ w.t()).to(x.dtype)
