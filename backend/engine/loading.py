"""Loading a checkpoint into an engine: on a thread that exits (in_fresh_thread: the engine thread's OpenMP
pool stays the only one), with the checkpoint's fingerprint (model_fingerprint: part of every page's identity)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.model.loader import load_model
from edgeinfer.protocol.tokenizer import Tokenizer


def model_fingerprint(path: str | Path) -> str:
    path = Path(path)
    h = xxhash.xxh3_64()
    h.update((path / "config.json").read_bytes() if (path / "config.json").is_file() else b"")
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 16))
    return h.hexdigest()


def in_fresh_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a new thread that exits when it returns; its result, or its exception.

    For torch work on CPU outside the engine thread (loading a model). libgomp gives every thread that
    runs a parallel region its own worker pool, kept until that thread exits; once the pools hold more
    threads than there are CPUs, every worker spins only 100 times before sleeping, so each of the ~600
    parallel ops of a decode step pays a futex wake-up (measured at 32 sequences on 2 cores: 52 ms per
    step with one pool, 70 ms once the main thread has a pool too). A thread that exits frees its pool.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name="edgeinfer-torch-oneshot")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


# (model, tokenizer, model_dir, fingerprint) -> the KV dtype to build the engine with (server: the measured gate)
KVChooser = Callable[[Any, Tokenizer, Path, str], str]


def load_engine(model_dir: str | Path, cfg: EngineConfig | None = None, dtype: torch.dtype = torch.float32,
                device: str = "cpu", model_name: str | None = None, kv_chooser: KVChooser | None = None
                ) -> LLMEngine:
    """Load on a thread that exits (see in_fresh_thread): the engine thread's OpenMP pool stays the only one.
    kv_chooser, when given, picks cfg.kv_dtype from the loaded model before the engine is built (one load)."""
    return in_fresh_thread(_load_engine, model_dir, cfg, dtype, device, model_name, kv_chooser)


def _load_engine(model_dir, cfg, dtype, device, model_name, kv_chooser=None) -> LLMEngine:
    model_dir = Path(model_dir)
    model = load_model(model_dir, dtype=dtype, device=device, mtp=cfg is not None and cfg.speculative == "mtp")
    tok = Tokenizer.from_dir(model_dir, model_vocab_size=model.cfg.vocab_size)
    fingerprint = model_fingerprint(model_dir)
    if kv_chooser is not None:
        cfg = replace(cfg or EngineConfig(), kv_dtype=kv_chooser(model, tok, model_dir, fingerprint))
    return LLMEngine(model, tok, cfg, fingerprint=fingerprint, model_name=model_name or model_dir.name)
