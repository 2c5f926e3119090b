"""Speed of the served head with its exact outlier channels (Q8Linear.keep_exact, docs/notes/ppl.md) on and off,
alternating A/B in one process (the same model, its head switched) so that a shared box's drift lands on both
sides alike, at three levels:

  op      the head op alone (q8_0x8_gemm_exact vs q8_0x8_gemm) at 1 and 32 rows, sides interleaved call by call
  step    teacher-forced decode steps of the model (ppl_breakdown.decode_logits: forward + head, no engine) at
          batch 1 and 32
  engine  the served engine's decode tok/s (benchmarks.bench_engine.run_engine) at batch 1 and 32 (noisiest)

  OMP_NUM_THREADS=1 python benchmarks/bench_head_exact.py [--levels op,step,engine] [--rounds 4]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    from benchmarks.bench_engine import run_engine
    from benchmarks.peer_engine import served_engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="op,step,engine")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--npl", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=48)
    a = ap.parse_args()
    eng, _ = served_engine()
    model = eng.model
    head = model.lm_head_linear
    idx = head.exact_idx
    assert idx is not None, "the served head keeps no exact channels"
    cols = head.exact_w

    def side_on(side: str) -> None:   # switch without recomputing the columns (no 28 MB temporary between rounds)
        head.exact_idx, head.exact_w = (idx, cols) if side == "exact" else (None, None)
    g = torch.Generator().manual_seed(0)
    out: dict = {"exact_channels": idx.tolist(), "threads": torch.get_num_threads()}
    levels = a.levels.split(",")

    def summary(t: dict) -> dict:
        med = {k: statistics.median(v) for k, v in t.items()}
        return {"min_ms": {k: round(min(v), 4) for k, v in t.items()}, "median_ms": {k: round(v, 4) for k, v in med.items()},
                "median_exact_over_plain": med["exact"] / med["plain"],
                "min_exact_over_plain": min(t["exact"]) / min(t["plain"])}

    if "op" in levels:
        import edgeinfer.kernels.cpu as ck

        out["op"] = {}
        for c, reps in ((1, 100 * a.rounds), (32, 40 * a.rounds)):
            x = torch.randn(c, model.cfg.hidden_size, generator=g)
            t: dict = {"plain": [], "exact": []}
            for i in range(reps):
                for side in ("plain", "exact") if i % 2 else ("exact", "plain"):
                    s = time.perf_counter()
                    if side == "plain":
                        ck.q8_0x8_gemm(x, head.qs, head.d, head.out_features)
                    else:
                        ck.q8_0x8_gemm_exact(x, head.qs, head.d, head.out_features, idx, head.exact_w)
                    t[side].append((time.perf_counter() - s) * 1e3)
            out["op"][c] = summary(t)
            print(f"op rows {c}: {out['op'][c]}", file=sys.stderr, flush=True)
    if "step" in levels:
        from benchmarks.ppl_breakdown import decode_logits

        out["step"] = {}
        for c, rounds in ((1, 3 * a.rounds), (32, a.rounds + a.rounds % 2)):
            t = {"plain": [], "exact": []}
            for r in range(rounds):
                for side in ("plain", "exact") if r % 2 else ("exact", "plain"):
                    side_on(side)
                    chunks = torch.randint(100, 49000, (c, 25), generator=g).tolist()
                    s = time.perf_counter()
                    decode_logits(model, chunks, "auto")
                    t[side].append((time.perf_counter() - s) / 24 * 1e3)
            side_on("exact")
            out["step"][c] = summary(t)
            print(f"step batch {c}: {out['step'][c]}", file=sys.stderr, flush=True)
    if "engine" in levels:
        run_engine(eng, [torch.randint(100, 49000, (16,), generator=g).tolist() for _ in range(2)], 4, "warm")
        out["engine"] = {}
        for c in a.npl:
            res: dict = {"exact": {"decode": [], "prefill": []}, "plain": {"decode": [], "prefill": []}}
            for r in range(a.rounds):
                for side in ("exact", "plain") if r % 2 == 0 else ("plain", "exact"):
                    side_on(side)
                    prompts = [torch.randint(100, 49000, (a.npp,), generator=g).tolist() for _ in range(c)]
                    first, total = run_engine(eng, prompts, a.ntg, f"{side}{c}-{r}")
                    res[side]["decode"].append(c * (a.ntg - 1) / (total - first))
                    res[side]["prefill"].append(c * a.npp / first)
            side_on("exact")
            res["decode_exact_over_plain"] = (statistics.median(res["exact"]["decode"])
                                              / statistics.median(res["plain"]["decode"]))
            res["prefill_exact_over_plain"] = (statistics.median(res["exact"]["prefill"])
                                               / statistics.median(res["plain"]["prefill"]))
            out["engine"][c] = res
            print(f"engine batch {c}: decode exact/plain {res['decode_exact_over_plain']:.4f}", file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
