"""Guarded Triton import, shared by the kernel files.

Triton is imported only where a kernel can run: a CUDA device is present, or the
interpreter was requested (TRITON_INTERPRET=1, set before this module is first
imported). Elsewhere, and on machines without triton, `jit` leaves the kernel a
plain function and the references still import; `require_triton` names the op
that cannot launch.
"""

from __future__ import annotations

import functools
import os
import types

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:
    if not (INTERPRET or torch.cuda.is_available()):
        raise ImportError("no CUDA device and TRITON_INTERPRET is not 1")
    import triton
    import triton.language as tl

    HAS_TRITON = True
    IMPORT_ERROR = ""
except ImportError as e:  # CPU-only machine: references only
    triton = None
    tl = types.SimpleNamespace(constexpr=None)  # only read by kernel annotations
    HAS_TRITON = False
    IMPORT_ERROR = str(e)


def jit(fn):
    return triton.jit(fn) if HAS_TRITON else fn


def require_triton(op: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: Triton kernel unavailable ({IMPORT_ERROR}); use the reference")


def upcast_dot(dtype: torch.dtype) -> bool:
    """The Triton 3.9 interpreter's tl.dot multiplies bf16 operands as raw uint16 bits; in the
    interpreter only, bf16 tiles go to tl.dot as fp32 (same values, exact products)."""
    return INTERPRET and dtype == torch.bfloat16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: keep grids small, still exercise split paths


def check(cond: bool, message) -> None:
    """Raise ValueError(message()) when cond is false; the message is only built on failure."""
    if not cond:
        raise ValueError(message())


def check_tensor(name: str, t, *, dtypes=None, ndim=None, contiguous=False, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} dtype must be one of ({names}), got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_fp8_scale(name: str, scale, cache: torch.Tensor) -> None:
    # scale: [num_pages, page_size, kv_heads] float32 or bfloat16, beside a float8_e4m3fn or int8 cache
    if scale is None:
        raise ValueError(f"{name} is required with a {cache.dtype} cache")
    check_tensor(name, scale, dtypes=(torch.float32, torch.bfloat16), ndim=3, contiguous=True, device=cache.device)
    if scale.shape != cache.shape[:3]:
        raise ValueError(f"{name} shape {tuple(scale.shape)} != [num_pages, page_size, kv_heads] = "
                         f"{tuple(cache.shape[:3])}")
