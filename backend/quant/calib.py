"""Offline text for calibration and evaluation, and teacher-forced forwards through the paged model.

Calibration and evaluation text come from different files (disjoint by construction):
  calibration "tqdm": the tqdm package's METADATA (its README; tqdm is a runtime dependency)
  calibration "mix" (default): several texts interleaved chunk by chunk: CPython's Lib/pydoc_data/topics.py
               (the language reference's prose, as pydoc shows it) and the METADATA (README) of tqdm,
               torch, transformers and numpy where installed
  evaluation:  CPython's Lib/idlelib/NEWS.txt (ships with the interpreter)
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch

from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.model_runner import ModelRunner
from edgeinfer.backend.model.decoder import DecoderModel


def calibration_text() -> tuple[str, str]:
    dist = importlib.metadata.distribution("tqdm")
    text = dist.read_text("METADATA")
    if not text:
        raise FileNotFoundError("tqdm METADATA not found: cannot calibrate")
    return text, f"tqdm-{dist.version}.dist-info/METADATA"


CALIB_DISTS = ("tqdm", "torch", "transformers", "numpy")
CALIBRATIONS = ("mix", "tqdm")


def calibration_sources(which: str = "mix") -> list[tuple[str, str]]:
    """-> [(text, source name)]; "mix": pydoc topics first, then the distributions' METADATA."""
    if which == "tqdm":
        return [calibration_text()]
    if which != "mix":
        raise ValueError(f"unknown calibration {which!r}; supported: {', '.join(CALIBRATIONS)}")
    out: list[tuple[str, str]] = []
    try:
        import pydoc_data.topics as topics

        out.append(("\n\n".join(topics.topics.values()), "CPython Lib/pydoc_data/topics.py"))
    except ImportError:
        pass
    for name in CALIB_DISTS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        text = dist.read_text("METADATA")
        if text:
            out.append((text, f"{name}-{dist.version}.dist-info/METADATA"))
    if not out:
        raise FileNotFoundError("no calibration text found (pydoc_data, tqdm/torch/transformers/numpy METADATA)")
    return out


def interleaved_chunks(token_lists: list[list[int]], num: int, length: int) -> list[list[int]]:
    """Up to num chunks of length tokens, taken round-robin across the texts (in order within each)."""
    pools = [[ids[i * length:(i + 1) * length] for i in range(len(ids) // length)] for ids in token_lists]
    out: list[list[int]] = []
    depth = 0
    while len(out) < num and any(depth < len(p) for p in pools):
        for p in pools:
            if depth < len(p) and len(out) < num:
                out.append(p[depth])
        depth += 1
    return out


def eval_text() -> tuple[str, str]:
    import idlelib

    path = Path(idlelib.__file__).parent / "NEWS.txt"
    return path.read_text(encoding="utf-8"), f"CPython {path.parent.name}/NEWS.txt"


def token_chunks(ids: list[int], num: int, length: int) -> list[list[int]]:
    if len(ids) < num * length:
        raise ValueError(f"text has {len(ids)} tokens; need {num} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(num)]


def paged_prefill(model: DecoderModel, chunks: list[list[int]], kv_dtype: str = "auto", page_size: int = 16) -> torch.Tensor:
    """One teacher-forced forward of several sequences through the engine's paged KV pool (any KV dtype, fp8
    included) -> hidden [sum(len), h]."""
    pages = sum((len(c) + page_size - 1) // page_size for c in chunks)
    runner = ModelRunner(model, EngineConfig(page_size=page_size, num_pages=pages, kv_dtype=kv_dtype))
    return model.scratch_prefill(chunks, runner.kv, page_size)
