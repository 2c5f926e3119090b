"""page_checksum: a 64-bit checksum of each KV page's bytes, computed where the pool lives.

The engine records a checksum when a page is sealed (full, entered in the prefix cache) and checks it when
another request reuses the page (backend/engine/kv_integrity.py). On CPU that checksum is xxh3-64 over the
pool's bytes (the xxhash library, in C). On CUDA the pages are hashed on the device by this kernel, so a check
reads no page back to the host: one program per page, over its bytes as 32-bit words w_i, two lanes

    lo = sum_i mix(w_i ^ (i * C0))                  mod 2^32
    hi = sum_i mix((w_i + i * C1 + 1)) * (2i + 1)   mod 2^32

with mix the murmur3 finalizer (shifts and two odd multipliers). Every word's contribution depends on its
position, so a flipped bit, a changed word, two swapped words or another page's bytes change the sum except
with probability ~2^-64 for a random change. It guards against accidents in the live pool (a page reused
too early, a wrong block-table entry), not against an attacker: pages that cross a trust boundary carry the
keyed MAC (cache_store/codec.py).

Arithmetic is in int64 masked to 32 bits after every multiply (the low 32 bits of a wrapped 64-bit product
are exact), so the reference (torch) and the kernel (Triton, compiled or interpreted) give the same bits.
The multipliers are below 2^31 so no literal needs an unsigned type.
"""

from __future__ import annotations

import torch

from edgeinfer.kernels._triton import check, check_tensor, jit, require_triton, tl

M32 = 0xFFFFFFFF
C0 = 0x1B873593          # position salts
C1 = 0x7FEB352D
F1 = 0x2C1B3C6D          # the mixer's multipliers (odd, < 2^31)
F2 = 0x297A2D39
BLOCK = 1024


def _mix_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * F1) & M32
    x = x ^ (x >> 13)
    x = (x * F2) & M32
    return x ^ (x >> 16)


def _words(buf: torch.Tensor) -> torch.Tensor:
    check_tensor("buf", buf, dtypes=(torch.uint8,), ndim=2, contiguous=True)
    check(buf.shape[1] % 4 == 0, lambda: f"buf has {buf.shape[1]} bytes per page: expected a multiple of 4")
    return buf.view(torch.int32)


def page_checksum_reference(buf: torch.Tensor) -> torch.Tensor:
    # buf: [n, page_bytes] uint8, contiguous (page_bytes % 4 == 0) -> [n] int64
    w = _words(buf).to(torch.int64) & M32
    i = torch.arange(w.shape[1], dtype=torch.int64, device=w.device)
    lo = _mix_ref(w ^ ((i * C0) & M32)).sum(1) & M32
    hi = ((_mix_ref((w + i * C1 + 1) & M32) * (2 * i + 1)) & M32).sum(1) & M32
    return (hi << 32) | lo


@jit
def _mix(x):
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    return x ^ (x >> 16)


@jit
def _page_checksum_kernel(w_ptr, out_ptr, num_words, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc_lo = tl.zeros([BLOCK], dtype=tl.int64)
    acc_hi = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, num_words, BLOCK):
        i = start + tl.arange(0, BLOCK).to(tl.int64)
        keep = i < num_words
        w = tl.load(w_ptr + row * num_words + i, mask=keep, other=0).to(tl.int64) & 0xFFFFFFFF
        lo = _mix(w ^ ((i * 0x1B873593) & 0xFFFFFFFF))
        hi = (_mix((w + i * 0x7FEB352D + 1) & 0xFFFFFFFF) * (2 * i + 1)) & 0xFFFFFFFF
        acc_lo += tl.where(keep, lo, 0)
        acc_hi += tl.where(keep, hi, 0)
    lo_sum = tl.sum(acc_lo, axis=0) & 0xFFFFFFFF
    hi_sum = tl.sum(acc_hi, axis=0) & 0xFFFFFFFF
    tl.store(out_ptr + row, (hi_sum << 32) | lo_sum)


def page_checksum_triton(buf: torch.Tensor) -> torch.Tensor:
    # buf: [n, page_bytes] uint8, contiguous (page_bytes % 4 == 0) -> [n] int64
    require_triton("page_checksum")
    w = _words(buf)
    out = torch.empty(w.shape[0], dtype=torch.int64, device=w.device)
    if w.shape[0]:
        _page_checksum_kernel[(w.shape[0],)](w, out, w.shape[1], BLOCK=BLOCK)
    return out
