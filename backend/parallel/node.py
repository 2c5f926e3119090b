"""One backend node over several ranks (`edgeinfer backend --tensor-parallel N [--expert-parallel]`).

Rank 0 is the backend process: server, scheduler, sampler, page store. It starts ranks 1..N-1 as child processes
(`python -m edgeinfer.backend.parallel.worker`), all of them join one torch.distributed group (gloo on CPU), and
every rank loads the checkpoint and keeps its shard (backend/parallel/shard.py). The engine on rank 0 sees a
`TensorParallelModel`: each forward first broadcasts the step (token ids, positions, the attention metadata) and
each logits call the rows to score, so the other ranks run the same collectives in the same order
(`worker_loop`). Page bodies for the page store are gathered from every rank and written back to every rank
(`gather_pages` / `scatter_pages`), so a page holds all ranks' KV heads in the TP=1 layout: a TP=2 node and a
TP=1 node of the same model and KV format share pages (docs/CACHE_STORE.md).

A rank that dies: rank 0's watchdog sees the child exit and stops the node (SIGTERM to itself, a hard exit if
that does not finish in time); a collective that a dead rank never joins fails at the group's timeout instead of
hanging. The gateway then sees the node fail its probes and routes elsewhere.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.kv_pool import lazy_zeros
from edgeinfer.backend.engine.loading import model_fingerprint
from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV, PageIO
from edgeinfer.backend.model.decoder import DecoderModel
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.model.model_config import ModelConfig
from edgeinfer.backend.model.mtp import MTPLayer
from edgeinfer.backend.parallel.comm import Comm
from edgeinfer.backend.parallel.shard import local_config, shard_model
from edgeinfer.protocol.tokenizer import Tokenizer

log = logging.getLogger("edgeinfer.parallel")


def load_shard(model_dir: str | Path, comm: Comm, expert_parallel: bool, dtype: torch.dtype = torch.float32,
               device: str = "cpu", prepack: bool = True) -> DecoderModel:
    model = load_model(model_dir, dtype=dtype, device=device, fuse_gate_up=True, prepack=False)
    shard_model(model, comm, expert_parallel)
    if prepack:
        model.prepack()
    return model


class TensorParallelModel:
    """Rank 0's face of the node: the engine's model. Its own shard computes; every call is mirrored on the other
    ranks first. Everything else (cfg: this rank's view, dtype, device, weight_bytes, ...) is the shard's."""

    def __init__(self, shard: DecoderModel, comm: Comm) -> None:
        self.shard, self.comm = shard, comm
        self._pool: int | None = None   # id of the pool the other ranks mirror (a new pool: they allocate its twin)

    @property
    def tp_world(self) -> int:
        """Ranks of the node (backend/page_store/bridge.py: a page body holds every rank's share)."""
        return self.comm.world

    def __getattr__(self, name: str):
        return getattr(self.shard, name)

    # PagedModel (backend/model/paged.py): the shard's
    @property
    def cfg(self) -> ModelConfig:
        return self.shard.cfg

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    @property
    def mtp(self) -> MTPLayer | None:
        return self.shard.mtp

    def weight_bytes(self) -> int:
        return self.shard.weight_bytes()

    def prepacked_copy_bytes(self) -> int:
        return self.shard.prepacked_copy_bytes()

    def _sync_pool(self, kv_caches: list[LayerKV]) -> None:
        kv = kv_caches[0]
        if self._pool == id(kv.k):
            return
        spec = [(tuple(t.shape), t.dtype) if t is not None else None for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)]
        self.comm.broadcast_object(("pool", len(kv_caches), spec, kv.hadamard))
        self._pool = id(kv.k)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                 meta: AttentionMetadata) -> torch.Tensor:
        self._sync_pool(kv_caches)
        self.comm.broadcast_object(("step", input_ids, positions, meta))
        return self.shard(input_ids, positions, kv_caches, meta)

    forward = __call__

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.comm.broadcast_object(("logits", hidden))
        return self.shard.compute_logits(hidden)

    def page_io(self, kv: list[LayerKV]) -> NodePageIO:
        """Page bodies of every rank's share (a TP=1 pool's layout), through the group."""
        return NodePageIO(self, kv)

    def stop_workers(self) -> None:
        try:
            self.comm.broadcast_object(("stop",))
        except RuntimeError:
            pass


class NodePageIO(PageIO):
    """A node's page bodies: read gathers each rank's KV heads, write scatters them (collectives on the group)."""

    def __init__(self, node: TensorParallelModel, kv: list[LayerKV]) -> None:
        super().__init__(kv)
        self.node = node
        self.world = node.comm.world

    def read(self, pages: list[int]) -> torch.Tensor:
        return gather_pages(self.node, self.kv, pages)

    def read_on_device(self, pages: list[int]) -> torch.Tensor:
        return self.read(pages)

    def write(self, pages: list[int], buf: torch.Tensor) -> None:
        scatter_pages(self.node, self.kv, pages, buf)


def worker_loop(shard: DecoderModel, comm: Comm) -> None:
    """Ranks 1..N-1: mirror rank 0's calls until it says stop (or the group fails)."""
    kv: list[LayerKV] = []
    device = shard.device
    with torch.inference_mode():
        while True:
            cmd = comm.broadcast_object()
            kind = cmd[0]
            if kind == "pool":
                _, layers, spec, hadamard = cmd
                kv = [LayerKV(*(lazy_zeros(s[0], s[1], device) if s is not None else None  # type: ignore[arg-type, misc]
                                for s in spec), hadamard=hadamard) for _ in range(layers)]
            elif kind == "step":
                _, ids, pos, meta = cmd
                shard(ids, pos, kv, meta)
            elif kind == "logits":
                shard.compute_logits(cmd[1])
            elif kind == "gather":
                comm.gather_tensors(_local_rows(kv, cmd[1]))
            elif kind == "scatter":
                _write_local_rows(kv, cmd[1], comm.scatter_tensors(None, _row_block(kv, len(cmd[1]))))
            elif kind == "stop":
                return


# ---- page bodies across ranks: every rank's KV heads in the TP=1 body layout
def _parts(kv: list[LayerKV]) -> list[torch.Tensor]:
    return [t for layer in kv for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]


def _local_rows(kv: list[LayerKV], pages: list[int]) -> torch.Tensor:
    idx = torch.tensor(pages, dtype=torch.long)
    return torch.cat([t.view(torch.uint8).index_select(0, idx).reshape(len(pages), -1) for t in _parts(kv)], dim=1)


def _write_local_rows(kv: list[LayerKV], pages: list[int], buf: torch.Tensor) -> None:
    idx = torch.tensor(pages, dtype=torch.long)
    for t, rows in zip(_parts(kv), _split_rows(kv, buf), strict=True):
        t.view(torch.uint8).index_copy_(0, idx, rows)


def _page_shapes(kv: list[LayerKV]) -> list[torch.Size]:
    """One page of each pool part, as bytes: [page_size, kv_heads_local, ...] (the body order)."""
    return [t.view(torch.uint8).shape[1:] for t in _parts(kv)]


def _row_block(kv: list[LayerKV], n: int) -> torch.Tensor:
    """An empty [n, local page bytes] block: the shape a rank's share of n page bodies arrives in."""
    return torch.empty((n, sum(s.numel() for s in _page_shapes(kv))), dtype=torch.uint8)


def _split_rows(kv: list[LayerKV], buf: torch.Tensor) -> list[torch.Tensor]:
    """A local body row block [n, bytes] -> its parts [n, page_size, kv_heads_local, ...] (uint8 views)."""
    out, off = [], 0
    for shape in _page_shapes(kv):
        nb = shape.numel()
        out.append(buf[:, off:off + nb].reshape((buf.shape[0], *shape)))
        off += nb
    return out


def gather_pages(node: TensorParallelModel, kv: list[LayerKV], pages: list[int]) -> torch.Tensor:
    """[len(pages), full page bytes]: each part's rank shards joined along the KV-head dim (dim 2 of
    [n, page_size, heads, bytes...]), i.e. what a TP=1 pool of the same model would hold."""
    node._sync_pool(kv)
    node.comm.broadcast_object(("gather", pages))
    shards = node.comm.gather_tensors(_local_rows(kv, pages))
    assert shards is not None
    per_rank = [_split_rows(kv, s) for s in shards]
    n = len(pages)
    return torch.cat([torch.cat([r[i] for r in per_rank], dim=2).reshape(n, -1) for i in range(len(per_rank[0]))],
                     dim=1)


def scatter_pages(node: TensorParallelModel, kv: list[LayerKV], pages: list[int], buf: torch.Tensor) -> None:
    """The inverse: full page bodies split by KV heads, each rank's share written into its pool."""
    node._sync_pool(kv)
    world = node.comm.world
    n = len(pages)
    full, off = [], 0
    for shape in _page_shapes(kv):
        nb = shape.numel() * world
        full.append(buf[:, off:off + nb].reshape((n, shape[0], shape[1] * world, *shape[2:])))
        off += nb
    if off != buf.shape[1]:
        raise ValueError(f"page body of {buf.shape[1]} bytes, the node's KV pool needs {off}")
    shards = [torch.cat([f.chunk(world, dim=2)[r].reshape(n, -1) for f in full], dim=1).contiguous()
              for r in range(world)]
    node.comm.broadcast_object(("scatter", pages))
    mine = node.comm.scatter_tensors(shards, shards[0])
    _write_local_rows(kv, pages, mine)


def run_rank(rank: int, world: int, port: int, model_dir: str | Path, expert_parallel: bool, fn,
             timeout_s: float = 120.0):
    """One rank of a group started by the caller (torch.multiprocessing: tests, benchmarks): rank 0 returns
    fn(TensorParallelModel) and then tells the others to stop; the others mirror it until then. Every rank leaves
    the group on the way out. None on ranks > 0."""
    comm = Comm.init(rank, world, master_port=port, timeout_s=timeout_s)
    try:
        shard = load_shard(model_dir, comm, expert_parallel)
        if rank:
            worker_loop(shard, comm)
            return None
        node = TensorParallelModel(shard, comm)
        try:
            return fn(node)
        finally:
            node.stop_workers()
    finally:
        comm.close()


# ---- starting a node
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """Rank 0's handle: the workers' processes, the group and the watchdog."""

    def __init__(self, procs: list[subprocess.Popen], comm: Comm) -> None:
        self.procs, self.comm = procs, comm
        self.stopping = False
        self.failed = False
        threading.Thread(target=self._watch, name="edgeinfer-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None and not self.stopping:
                    log.error("tensor-parallel rank %d exited with %s: stopping this node", rank, p.returncode)
                    self.stopping = self.failed = True
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(15)
                    os._exit(3)   # the orderly stop did not finish (a collective waiting on the dead rank)
            time.sleep(0.2)

    def stop(self) -> None:
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def load_parallel_engine(model_dir: str | Path, cfg, world: int, expert_parallel: bool, dtype: str = "float32",
                         model_name: str | None = None):
    """The engine of a tensor-parallel node (rank 0), and the node's handle."""
    model_dir = Path(model_dir)
    model, node = start_node(model_dir, world, expert_parallel, dtype)
    tok = Tokenizer.from_dir(model_dir, model_vocab_size=model.cfg.vocab_size)
    engine = LLMEngine(model, tok, cfg, fingerprint=model_fingerprint(model_dir),
                       model_name=model_name or model_dir.name)
    return engine, node


def start_node(model_dir: str | Path, world: int, expert_parallel: bool, dtype: str = "float32",
               timeout_s: float = 120.0) -> tuple[TensorParallelModel, Node]:
    """Rank 0: start ranks 1..world-1, join the group, load this rank's shard."""
    local_config(ModelConfig.from_dir(model_dir), world, expert_parallel)   # a size that does not split: one clear
    # error, no rank started
    port = free_port()
    threads = max(1, (os.cpu_count() or world) // world)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs = [subprocess.Popen([sys.executable, "-m", "edgeinfer.backend.parallel.worker", "--model", str(model_dir),
                               "--rank", str(r), "--world", str(world), "--master-port", str(port), "--dtype", dtype,
                               "--timeout", str(timeout_s), *(["--expert-parallel"] if expert_parallel else [])],
                              env=env, start_new_session=False) for r in range(1, world)]
    torch.set_num_threads(threads)
    comm = Comm.init(0, world, master_port=port, timeout_s=timeout_s)
    node = Node(procs, comm)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    shard = load_shard(model_dir, comm, expert_parallel, dtype=dt)
    return TensorParallelModel(shard, comm), node
