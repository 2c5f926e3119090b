"""The guard that keeps test-only KV fault injection out of every deployment (the faults themselves live with the
tests: tests/support/kv_faults.py). Torch-free: `edgeinfer serve` calls it before anything starts."""

from __future__ import annotations

import os

ENV = "EDGEINFER_KV_FAULT_INJECTION"


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def refuse_in_production() -> None:
    """Called by `edgeinfer backend` and `edgeinfer serve` before anything starts."""
    if os.environ.get(ENV, "") not in ("", "0"):
        raise SystemExit(f"{ENV}={os.environ[ENV]!r} is set: KV fault injection exists for the test suite only; "
                         f"unset it to start a backend")
