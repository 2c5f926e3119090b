"""`python -m edgeinfer.backend.parallel.worker`: rank r (>= 1) of a tensor-parallel backend node; started by rank 0
(backend/parallel/node.py), never by hand. Loads its shard, then mirrors rank 0's calls until told to stop."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from edgeinfer.backend.parallel.comm import Comm
from edgeinfer.backend.parallel.node import load_shard, worker_loop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--expert-parallel", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level="WARNING", stream=sys.stderr)

    comm = Comm.init(a.rank, a.world, master_port=a.master_port, timeout_s=a.timeout)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
    try:
        worker_loop(load_shard(a.model, comm, a.expert_parallel, dtype=dtype), comm)
    except (RuntimeError, ValueError) as e:   # the group failed (rank 0 or a peer is gone), or the shard is refused
        print(f"edgeinfer tp rank {a.rank}: stopping: {e}", file=sys.stderr)
        return 1
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
