"""Ranks of a tensor-parallel group for the tests, started with torch.multiprocessing (spawn): rank 0 runs the
paged model (prefill + greedy) through TensorParallelModel and saves its logits and tokens, the other ranks run
backend.parallel.node.worker_loop. gloo on CPU, loopback."""

from __future__ import annotations

import sys
from pathlib import Path


def run_rank(rank: int, world: int, port: int, model_dir: str, expert_parallel: bool, prompt: list[int], steps: int,
             out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    import torch

    torch.set_num_threads(1)
    from edgeinfer.backend.parallel.node import run_rank as group_rank
    from tests.support.dense import greedy

    def run(node) -> None:
        logits, tokens = greedy(node, prompt, steps, num_pages=8)
        torch.save({"logits": logits, "tokens": tokens, "stats": node.comm.stats.snapshot(),
                    "local_kv_heads": node.shard.cfg.num_kv_heads}, out)
    group_rank(rank, world, port, model_dir, expert_parallel, run, timeout_s=60)
