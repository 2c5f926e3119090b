"""CUDA graphs for decode-only steps, one graph per batch-size bucket.

A decode step launches a few hundred small kernels whose launch cost, not their work, bounds a small
model's decode speed on a GPU. A captured graph replays them with one launch. Graphs need fixed shapes
and fixed addresses, so:
  - a step of n decoding sequences runs the graph of the smallest bucket >= n (decode_buckets);
  - its inputs are copied into static buffers sized for the largest bucket ([4, max_bucket] int64:
    ids, positions, slots, context lens; [max_bucket, width] int32 block tables), rows n.. padded with
    slot -1 (kv_store skips it) and context 0 (decode attention returns zeros), so padding writes no KV
    and reads none;
  - block tables have a fixed width (pages for max_model_len), so the decode kernel's split plan, which
    it derives from the table width, is the same at capture and at every replay.
Steps with prefill tokens, wider tables or more sequences than the largest bucket run eagerly.

Only the Triton kernels are capturable (the torch references sync on tensor values), so graphs are on
only on CUDA with Triton dispatch. EngineConfig.cuda_graphs=False or EDGEINFER_CUDA_GRAPHS=0 turns them
off. The capture itself is behind `Capture`: CudaCapture on a GPU, EagerCapture (runs the function again
on every replay, into the same output tensor) so the bucketing, padding and buffer reuse are tested on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV
from edgeinfer.backend.model.paged import PagedModel
from edgeinfer.kernels.dispatch import use_triton

GRAPHS_ENV = "EDGEINFER_CUDA_GRAPHS"
PAD_SLOT = -1          # kv_store skips the row
PAD_CONTEXT = 0        # decode attention reads no page and returns zeros


def graphs_env() -> bool | None:
    """EDGEINFER_CUDA_GRAPHS=0|1 overrides EngineConfig.cuda_graphs; unset -> None."""
    value = os.environ.get(GRAPHS_ENV)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{GRAPHS_ENV}={value!r}; expected 0 or 1")
    return value == "1"


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to (and including) max_num_seqs rounded up to a bucket."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}: expected >= 1")
    out: list[int] = []
    b = 1
    while not out or out[-1] < max_num_seqs:
        out.append(b)
        b = b * 2 if b < 8 else b + 8
    return tuple(out)


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket >= n; None when n exceeds the largest (the step runs eagerly)."""
    if n < 1:
        raise ValueError(f"pick_bucket(n={n}): expected >= 1 sequences")
    return next((b for b in buckets if b >= n), None)


def pad_rows(stage: np.ndarray, bucket: int, out: np.ndarray | None = None) -> np.ndarray:
    """stage [4, n] int64 rows (ids, positions, slots, context lens) -> [4, bucket], rows n.. padded:
    id 0, position 0, slot PAD_SLOT, context PAD_CONTEXT. `out` (>= [4, bucket]) is reused when given."""
    n = stage.shape[1]
    if stage.shape[0] != 4 or n > bucket:
        raise ValueError(f"pad_rows: stage shape {stage.shape} does not fit [4, {bucket}]")
    buf = np.empty((4, bucket), dtype=np.int64) if out is None else out[:, :bucket]
    buf[:, :n] = stage
    buf[:2, n:] = 0
    buf[2, n:] = PAD_SLOT
    buf[3, n:] = PAD_CONTEXT
    return buf


class Capture:
    """One captured function: capture(fn) runs/records it once and returns its output; replay() makes
    that same output tensor hold the result for the static inputs' current values."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def replay(self) -> None:
        raise NotImplementedError


class EagerCapture(Capture):
    """CPU stand-in: replay runs the function again and copies into the captured output."""

    captures = 0   # class-wide counters, read by tests
    replays = 0

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        EagerCapture.captures += 1
        return self.out

    def replay(self) -> None:
        with torch.inference_mode():   # the output is an inference tensor (the model runs in inference mode)
            self.out.copy_(self.fn())
        EagerCapture.replays += 1


class CudaCapture(Capture):
    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):     # warm-up: Triton compiles and picks its kernels outside the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        # thread_local: CUDA calls on other threads (none expected: the engine thread owns the device) don't
        # invalidate this capture
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """Static decode inputs, one captured forward (+ logits) per bucket, captured on first use."""

    def __init__(self, model: PagedModel, kv: list[LayerKV], buckets: tuple[int, ...], width: int,
                 make_capture: Callable[[], Capture]) -> None:
        if width < 1:
            raise ValueError(f"DecodeGraphs: table width {width} must be >= 1")
        self.model, self.kv, self.buckets, self.width = model, kv, buckets, width
        self.make_capture = make_capture
        dev, top = model.device, buckets[-1]
        self.rows = torch.zeros((4, top), dtype=torch.int64, device=dev)        # ids, pos, slots, ctx
        self.tables = torch.zeros((top, width), dtype=torch.int32, device=dev)
        pinned = dev.type == "cuda"
        self._host_rows = torch.zeros((4, top), dtype=torch.int64, pin_memory=pinned)
        self._host_tables = torch.zeros((top, width), dtype=torch.int32, pin_memory=pinned)
        self._empty_i32 = torch.zeros(0, dtype=torch.int32, device=dev)
        self._no_tables = torch.zeros((0, 1), dtype=torch.int32, device=dev)
        self._cu0 = torch.zeros(1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[Capture, torch.Tensor]] = {}

    def _forward(self, bucket: int) -> torch.Tensor:
        ids, pos, slots, ctx = self.rows[:, :bucket]
        meta = AttentionMetadata(
            slot_mapping=slots, num_decode=bucket,
            decode_block_tables=self.tables[:bucket], decode_context_lens=ctx.to(torch.int32),
            prefill_block_tables=self._no_tables, prefill_cu_seqlens_q=self._cu0,
            prefill_context_lens=self._empty_i32)
        return self.model.compute_logits(self.model(ids, pos, self.kv, meta))

    def _graph(self, bucket: int) -> tuple[Capture, torch.Tensor]:
        got = self.graphs.get(bucket)
        if got is None:
            # capture with every row padded: no KV written, no page read
            self.rows[:2].zero_()
            self.rows[2].fill_(PAD_SLOT)
            self.rows[3].fill_(PAD_CONTEXT)
            cap = self.make_capture()
            got = self.graphs[bucket] = (cap, cap.capture(lambda: self._forward(bucket)))
        return got

    def fits(self, n: int, table_width: int) -> bool:
        return 1 <= n <= self.buckets[-1] and table_width <= self.width

    def run(self, stage: np.ndarray, tables: np.ndarray) -> torch.Tensor | None:
        """stage [4, n] (the runner's rows for n decode tokens), tables [n, w] -> logits [n, vocab] on the
        device (a view of the graph's output: valid until the next run), or None when the step doesn't fit."""
        n, w = tables.shape
        if stage.shape[1] != n or not self.fits(n, w):
            return None
        bucket = pick_bucket(n, self.buckets)
        assert bucket is not None   # fits() checked n against the largest bucket
        cap, out = self._graph(bucket)
        pad_rows(stage, bucket, self._host_rows.numpy())
        self._host_tables.numpy()[:n, :w] = tables
        # no host sync: the copies are queued on the stream ahead of the replay
        self.rows[:, :bucket].copy_(self._host_rows[:, :bucket], non_blocking=True)
        self.tables[:n, :w].copy_(self._host_tables[:n, :w], non_blocking=True)
        cap.replay()
        return out[:n]


def decode_graphs_for(model: PagedModel, kv: list[LayerKV], enabled: bool, max_num_seqs: int,
                      width: int) -> DecodeGraphs | None:
    """DecodeGraphs on CUDA with Triton dispatch, unless disabled (config or EDGEINFER_CUDA_GRAPHS=0)."""
    env = graphs_env()
    if not (enabled if env is None else env) or model.device.type != "cuda":
        return None

    if not use_triton(torch.empty(0, device=model.device)):
        return None   # the references sync on tensor values: not capturable
    pool = torch.cuda.graph_pool_handle()
    return DecodeGraphs(model, kv, decode_buckets(max_num_seqs), width, lambda: CudaCapture(pool))
