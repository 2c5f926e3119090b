"""Ranks of a tensor-parallel group for the tests, started with torch.multiprocessing (spawn): rank 0 runs the
paged model (prefill + greedy) through TensorParallelModel and saves its logits and tokens, the other ranks run
backend.parallel.node.worker_loop. gloo on CPU, loopback."""

from __future__ import annotations

import sys
from pathlib import Path


def run_rank(rank: int, world: int, port: int, model_dir: str, expert_parallel: bool, prompt: list[int], steps: int,
             out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    torch.set_num_threads(1)
    from edgeinfer.backend.model.config import ModelConfig
    from edgeinfer.backend.parallel.comm import Comm
    from edgeinfer.backend.parallel.node import TensorParallelModel, load_shard, worker_loop
    from tests.backend.dense import greedy

    comm = Comm.init(rank, world, master_port=port, timeout_s=60)
    try:
        shard = load_shard(model_dir, comm, expert_parallel)
        if rank:
            worker_loop(shard, comm)
            return
        node = TensorParallelModel(shard, comm, ModelConfig.from_dir(model_dir))
        logits, tokens = greedy(node, prompt, steps, num_pages=8)
        stats = comm.stats.snapshot()
        node.stop_workers()
        torch.save({"logits": logits, "tokens": tokens, "stats": stats,
                    "local_kv_heads": shard.cfg.num_kv_heads}, out)
    finally:
        comm.close()
