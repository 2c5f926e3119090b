"""Kernel tests drive the Triton kernels on CPU through the Triton interpreter.

triton.jit reads TRITON_INTERPRET when a kernel is decorated and triton decorates its own
standard-library kernels when it is first imported, so the variable is set here, before
the first `import triton`, and the kernel modules are reloaded under it (kernels/_triton.py
skips the triton import on a CPU machine otherwise). The variable is then restored so that
it does not leak into other test folders; an autouse fixture sets it again around each
kernel test. With EDGEINFER_KERNEL_TEST_DEVICE=cuda the same tests run the compiled
kernels on a GPU instead (inputs built on CPU, moved by kernel_cases.on_device).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

_ON_GPU = os.environ.get("EDGEINFER_KERNEL_TEST_DEVICE") == "cuda"  # compiled kernels, no interpreter
_previous = os.environ.get("TRITON_INTERPRET")
_late = not _ON_GPU and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
    import triton.experimental.gluon  # noqa: F401  (imported lazily by launches; must load under the interpreter)

    from edgeinfer import kernels

    importlib.reload(kernels._triton)
    for name in ("_online_softmax", "kv_store", "w4a16_gemm", "paged_decode_attention", "paged_prefill_attention",
                 "fused_moe", "paged_mla_attention", "page_checksum"):
        importlib.reload(importlib.import_module(f"edgeinfer.kernels.{name}"))
finally:
    if _ON_GPU:
        pass
    elif _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if _late:
        pytest.fail("triton was imported before tests/kernels/triton/conftest.py could set TRITON_INTERPRET=1; "
                    "run `pytest tests/kernels/triton` in its own process")
    if not _ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
