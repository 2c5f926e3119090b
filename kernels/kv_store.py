"""kv_store: scatter new K/V rows into their cache pages through a slot mapping.

Quantized caches (QUANT_DTYPES: FP8 e4m3fn, INT8) get a scale per (token, kv head) = amax(|row|) / qmax
(448 for e4m3, 127 for int8: symmetric, round half to even, clamped to +-127), computed and applied
in the kernel, stored as float32 or bfloat16 (the dtype of the scale tensor; bf16 scales cost 2 bytes
instead of 4 per head and token; the scale is rounded to bf16 first and the row quantized with that
rounded scale, so dequantization uses exactly the scale the row was quantized with). The round-to-nearest-even onto the e4m3 grid is done in fp32
arithmetic (`_round_to_e4m3`), so the final cast only ever sees representable values: it
gives the same bytes as torch's `.to(torch.float8_e4m3fn)` on every backend (the Triton
3.9 interpreter's own float32 -> float8e4nv cast rounds ~2% of values wrongly).
"""

from __future__ import annotations

import torch

from edgeinfer.kernels._memo import LastCall
from edgeinfer.kernels._triton import check, check_fp8_scale, check_tensor, jit, next_pow2, require_triton, tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8 = torch.int8
INT8_MAX = 127.0
MIN_AMAX = 1e-8  # an all-zero row gets a tiny scale instead of a division by zero
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANT_DTYPES = (FP8, INT8)   # a scale per (token, kv head) beside the values
CACHE_DTYPES = (*ACT_DTYPES, *QUANT_DTYPES)
QMAX = {FP8: FP8_MAX, INT8: INT8_MAX}


def quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_DTYPES


def _amax_scale(x: torch.Tensor, qmax: float, dtype: torch.dtype) -> torch.Tensor:
    # x: [..., head_dim] -> [...] in `dtype` (bf16: round to nearest even)
    return (x.float().abs().amax(-1).clamp(min=MIN_AMAX) / qmax).to(dtype)


def fp8_scale(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _amax_scale(x, FP8_MAX, dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # torch.round: half to even; the bf16-rounded scale can put amax a hair past 127, hence the clamp
    return (x.float() / scale[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(INT8)


def quantize_rows(x: torch.Tensor, cache_dtype: torch.dtype, scale_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values in cache_dtype, scale [...] in scale_dtype), as every store path quantizes:
    the scale rounded to its dtype first, the row quantized with that rounded scale."""
    s = _amax_scale(x, QMAX[cache_dtype], scale_dtype)
    q = quantize_fp8(x, s.float()) if cache_dtype == FP8 else quantize_int8(x, s.float())
    return q, s


def _raw(t: torch.Tensor) -> torch.Tensor:
    # fp8 as raw bytes (index_copy_ / index_select have no fp8 on CPU)
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _rows(t: torch.Tensor) -> torch.Tensor:
    # [num_pages, page_size, ...] -> [num_pages * page_size, ...] view
    return _raw(t.flatten(0, 1))


def _kept(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """None when every slot is kept, else the mask of slots >= 0."""
    keep = slot_mapping >= 0
    return None if bool(keep.all()) else keep


_LAST_KEEP = LastCall()


def kv_store_reference(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    # key, value: [T, kv_heads, head_dim]; slot_mapping: [T] int64, -1 = skip
    # index_copy_ on a flat row view: advanced-index assignment is ~1000x slower on CPU here
    keep = _LAST_KEEP.get((slot_mapping,), None, lambda: _kept(slot_mapping))   # the same for every layer
    if keep is None:
        slots, k_src, v_src = slot_mapping, key, value
    else:
        slots, k_src, v_src = slot_mapping[keep], key[keep], value[keep]
    for src, cache, scale in ((k_src, k_cache, k_scale), (v_src, v_cache, v_scale)):
        if not cache.is_contiguous() or (scale is not None and not scale.is_contiguous()):
            pages, offs = slots // cache.shape[1], slots % cache.shape[1]   # a flat view would be a copy
            if quantized(cache.dtype):
                q, s = quantize_rows(src, cache.dtype, scale.dtype)
                cache[pages, offs] = q
                scale[pages, offs] = s
            else:
                cache[pages, offs] = src.to(cache.dtype)
            continue
        if quantized(cache.dtype):
            q, s = quantize_rows(src, cache.dtype, scale.dtype)
            _rows(cache).index_copy_(0, slots, _raw(q))
            _rows(scale).index_copy_(0, slots, s)
        else:
            _rows(cache).index_copy_(0, slots, src.to(cache.dtype))


@jit
def _round_to_e4m3(y):
    # y: fp32 within [-448, 448] -> the nearest e4m3fn value (ties to even), still fp32.
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    exponent = tl.maximum(exponent, -6)  # below 2**-6 the grid is the subnormal step 2**-9
    quantum = ((exponent - 3 + 127) << 23).to(tl.uint32).to(tl.float32, bitcast=True)
    inv_quantum = ((127 - exponent + 3) << 23).to(tl.uint32).to(tl.float32, bitcast=True)
    steps = tl.abs(y) * inv_quantum  # exact: powers of two
    steps = (steps + 12582912.0) - 12582912.0  # 1.5 * 2**23: fp32 add rounds to nearest even
    rounded = tl.minimum(steps * quantum, 448.0)
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@jit
def _round_to_bf16(x):
    # fp32 -> the nearest bf16 value (ties to even), still fp32; exact bit arithmetic, so the later
    # store into a bf16 tensor only ever sees representable values
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@jit
def _store_row(src_ptr, cache_ptr, scale_ptr, tok, page, off, valid,
               stride_st, stride_sh, stride_sd,
               stride_cp, stride_co, stride_ch, stride_cd,
               stride_qp, stride_qo, stride_qh,
               kv_heads, head_dim,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, SCALE_BF16: tl.constexpr,
               IS_INT8: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = tl.where(valid, kv_heads, 0)  # a skipped row (slot -1) masks every head
    mask = (h[:, None] < heads) & (d[None, :] < head_dim)
    x = tl.load(src_ptr + tok * stride_st + h[:, None] * stride_sh + d[None, :] * stride_sd, mask=mask, other=0.0)
    dst = cache_ptr + page * stride_cp + off * stride_co + h[:, None] * stride_ch + d[None, :] * stride_cd
    if QUANT:
        x = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8)
        qmax = 127.0 if IS_INT8 else 448.0
        scale = tl.math.div_rn(amax, qmax)
        if SCALE_BF16:
            scale = _round_to_bf16(scale)
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if IS_INT8:
            # |y| <= 127: adding 1.5 * 2**23 rounds to the nearest integer, ties to even (fp32 add), exactly
            y = (y + 12582912.0) - 12582912.0
        else:
            y = _round_to_e4m3(y)
        tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + page * stride_qp + off * stride_qo + h * stride_qh, scale.to(scale_ptr.dtype.element_ty),
                 mask=h < heads)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@jit
def _kv_store_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                     stride_st, stride_sh, stride_sd,
                     stride_cp, stride_co, stride_ch, stride_cd,
                     stride_qp, stride_qo, stride_qh,
                     page_size, kv_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                     SCALE_BF16: tl.constexpr, IS_INT8: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    page = slot // page_size
    off = slot % page_size
    _store_row(key_ptr, k_cache_ptr, k_scale_ptr, tok, page, off, valid,
               stride_st, stride_sh, stride_sd, stride_cp, stride_co, stride_ch, stride_cd,
               stride_qp, stride_qo, stride_qh, kv_heads, head_dim, BLOCK_H, BLOCK_D, QUANT, SCALE_BF16, IS_INT8)
    _store_row(value_ptr, v_cache_ptr, v_scale_ptr, tok, page, off, valid,
               stride_st, stride_sh, stride_sd, stride_cp, stride_co, stride_ch, stride_cd,
               stride_qp, stride_qo, stride_qh, kv_heads, head_dim, BLOCK_H, BLOCK_D, QUANT, SCALE_BF16, IS_INT8)


def _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    check_tensor("key", key, dtypes=ACT_DTYPES, ndim=3)
    check_tensor("value", value, dtypes=ACT_DTYPES, ndim=3)
    check_tensor("k_cache", k_cache, dtypes=CACHE_DTYPES, ndim=4, contiguous=True, device=key.device)
    check_tensor("v_cache", v_cache, dtypes=CACHE_DTYPES, ndim=4, contiguous=True, device=key.device)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1, contiguous=True, device=key.device)
    check(value.shape == key.shape, lambda: f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    check(value.stride() == key.stride(), lambda: f"value strides {value.stride()} != key strides {key.stride()}")
    check(v_cache.shape == k_cache.shape, lambda: f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    check(v_cache.dtype == k_cache.dtype, lambda: f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    check(key.shape[1:] == k_cache.shape[2:],
          lambda: f"key [T, kv_heads, head_dim] = {tuple(key.shape)} does not match k_cache "
          f"[num_pages, page_size, kv_heads, head_dim] = {tuple(k_cache.shape)}")
    check(slot_mapping.shape[0] == key.shape[0],
          lambda: f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    if quantized(k_cache.dtype):
        check_fp8_scale("k_scale", k_scale, k_cache)
        check_fp8_scale("v_scale", v_scale, k_cache)
    else:
        check(k_scale is None and v_scale is None,
              lambda: f"k_scale/v_scale are only for fp8/int8 caches, cache is {k_cache.dtype}")


def kv_store_triton(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    require_triton("kv_store")
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    quant = quantized(k_cache.dtype)
    scale_strides = k_scale.stride() if quant else (0, 0, 0)
    _kv_store_kernel[(tokens,)](
        key, value, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, slot_mapping,
        *key.stride(), *k_cache.stride(), *scale_strides,
        k_cache.shape[1], kv_heads, head_dim,
        BLOCK_H=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim), QUANT=quant,
        SCALE_BF16=quant and k_scale.dtype == torch.bfloat16, IS_INT8=k_cache.dtype == INT8,
    )

