"""One backend node's parallel group on torch.distributed (gloo on CPU, NCCL on CUDA): the collectives the sharded
model calls, each counting the bytes it moves (benchmarks/parallel.py reports them per step).

Rank 0 is the node's server, scheduler and sampler; it sends every step's inputs to the other ranks with
`broadcast_object` (a small pickled tuple: token ids, positions, slots, block tables) and every rank runs its shard.
The group has a timeout: a rank that dies turns the next collective into an error on the others (gloo: the
connection closes; a hang ends at the timeout), never a wait forever.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    all_gather_bytes: int = 0
    broadcast_calls: int = 0
    seconds: float = 0.0            # wall time inside the collectives (waiting for the slowest rank included)

    def snapshot(self) -> dict:
        return {"all_reduce_bytes": self.all_reduce_bytes, "all_reduce_calls": self.all_reduce_calls,
                "all_gather_bytes": self.all_gather_bytes, "broadcast_calls": self.broadcast_calls,
                "collective_seconds": round(self.seconds, 6)}


class Comm:
    """rank / world of this node's group, and its collectives (SUM all-reduce, all-gather along a dim,
    rank 0's broadcast of a Python object)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.stats = CommStats()

    @classmethod
    def init(cls, rank: int, world: int, master_addr: str = "127.0.0.1", master_port: int | None = None,
             backend: str | None = None, timeout_s: float = 120.0) -> Comm:
        """torchrun-style rendezvous (MASTER_ADDR / MASTER_PORT) on loopback by default."""
        if master_port is not None:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        backend = backend or ("nccl" if torch.cuda.is_available() and os.environ.get("EDGEINFER_TP_NCCL") else "gloo")
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, world)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In place, SUM over the ranks (the row-parallel linears' partial outputs)."""
        if self.world > 1:
            t0 = time.perf_counter()
            dist.all_reduce(t)
            self.stats.seconds += time.perf_counter() - t0
            self.stats.all_reduce_bytes += t.numel() * t.element_size()
            self.stats.all_reduce_calls += 1
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t concatenated along dim in rank order (the vocab-parallel head's logits)."""
        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        t0 = time.perf_counter()
        dist.all_gather(parts, t.contiguous())
        self.stats.seconds += time.perf_counter() - t0
        self.stats.all_gather_bytes += t.numel() * t.element_size() * (self.world - 1)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj=None):
        """Rank 0 sends obj; every rank returns it."""
        box = [obj]
        t0 = time.perf_counter()
        dist.broadcast_object_list(box, src=0)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.broadcast_calls += 1
        return box[0]

    def gather_tensors(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's t (same shape) to rank 0, which gets them in rank order (others: None)."""
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(t.contiguous(), parts, dst=0)
        return parts

    def scatter_tensors(self, parts: list[torch.Tensor] | None, like: torch.Tensor) -> torch.Tensor:
        """Rank 0's parts[r] to rank r (returned); `like` gives the shape and dtype."""
        out = torch.empty_like(like)
        dist.scatter(out, parts if self.rank == 0 else None, src=0)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
