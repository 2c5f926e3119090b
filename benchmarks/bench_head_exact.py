"""Decode (and prefill) speed of the served engine with the head's exact outlier channels (Q8Linear.keep_exact,
docs/notes/ppl.md) on and off, alternating A/B in one process (the same engine, its head switched between rounds)
so that a shared box's drift lands on both sides alike.

  OMP_NUM_THREADS=1 python benchmarks/bench_head_exact.py [--rounds 3] [--npl 1,32] [--ntg 48] [--npp 64]

Prints one JSON object: per batch size, the decode tok/s of every round of each side and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    from benchmarks.bench_engine import run_engine
    from benchmarks.peer_engine import served_engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--npl", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=48)
    a = ap.parse_args()
    eng, _ = served_engine()
    head = eng.model.lm_head_linear
    idx = head.exact_idx
    assert idx is not None, "the served head keeps no exact channels"
    g = torch.Generator().manual_seed(0)
    run_engine(eng, [torch.randint(100, 49000, (16,), generator=g).tolist() for _ in range(2)], 4, "warm")
    out: dict = {"exact_channels": idx.tolist(), "threads": torch.get_num_threads(), "batches": {}}
    for c in a.npl:
        res: dict = {"exact": {"decode": [], "prefill": []}, "plain": {"decode": [], "prefill": []}}
        for r in range(a.rounds):
            for side in (("exact", "plain") if r % 2 == 0 else ("plain", "exact")):
                head.keep_exact(idx if side == "exact" else None)
                prompts = [torch.randint(100, 49000, (a.npp,), generator=g).tolist() for _ in range(c)]
                first, total = run_engine(eng, prompts, a.ntg, f"{side}{c}-{r}")
                res[side]["decode"].append(c * (a.ntg - 1) / (total - first))
                res[side]["prefill"].append(c * a.npp / first)
        head.keep_exact(idx)
        res["decode_exact_over_plain"] = statistics.median(res["exact"]["decode"]) / statistics.median(res["plain"]["decode"])
        res["prefill_exact_over_plain"] = (statistics.median(res["exact"]["prefill"])
                                           / statistics.median(res["plain"]["prefill"]))
        out["batches"][c] = res
        print(f"batch {c}: decode exact/plain {res['decode_exact_over_plain']:.4f}", file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
