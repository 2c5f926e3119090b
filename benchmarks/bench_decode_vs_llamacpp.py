"""Batch-1 decode, side by side in one run: llama.cpp's `llama-bench` tg on the shipped GGUF vs edgeinfer's engine
built as `edgeinfer serve` builds it (benchmarks/peer_engine.py: native INT4, the served KV dtype), this tree and
optionally a baseline tree (e.g. the commit before a change), at the same thread count, interleaved round by
round (llama, this, baseline, llama, ...) so a noisy shared box hits all alike. Medians, ratios, and the load
average around each run.

  python benchmarks/bench_decode_vs_llamacpp.py [--threads 1] [--tg 64] [--rounds 3] [--baseline-tree DIR]
      [--llama-bench /work/peers/llama-build/tools-manual/llama-bench] [--out F]

Writes benchmarks/results/bench_decode_vs_llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
OUT = HERE.parent / "results" / "bench_decode_vs_llamacpp.json"
LLAMA_BENCH = Path("/work/peers/llama-build/tools-manual/llama-bench")


def _load() -> float:
    return os.getloadavg()[0]


def llama_tg(binary: Path, gguf: Path, threads: int, tg: int, timeout_s: float) -> dict:
    from benchmarks.peer_llamacpp import _env, parse_llama_bench

    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(tg), "-t", str(threads), "-r", "2", "-o", "json"]
    p = subprocess.run(cmd, env=_env(binary, binary.parents[1]), capture_output=True, text=True, timeout=timeout_s)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}:\n{(p.stdout + p.stderr)[-2000:]}")
    row = next(r for r in parse_llama_bench(p.stdout) if r["test"] == f"tg{tg}")
    return {"tok_s": row["tok_s"], "command": " ".join(cmd)}


def engine_tg(tree: Path, threads: int, tg: int, timeout_s: float) -> dict:
    cmd = [sys.executable, str(tree / "benchmarks" / "peer_engine.py"), "--tg", str(tg), "--reps", "2",
           "--npl", "1", "--npp", "16", "--ntg", "8", "--pp", "32"]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    p = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} in {tree} exited with {p.returncode}:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return {"tok_s": res[f"tg{tg}_tok_s"], "threads": res["threads"], "kv_format": res["kv_format"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-tree", default=None)
    ap.add_argument("--llama-bench", default=str(LLAMA_BENCH))
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    from edgeinfer.backend.model.gguf_import import default_gguf_path

    gguf = default_gguf_path()
    runners = {"llama.cpp": lambda: llama_tg(Path(a.llama_bench), gguf, a.threads, a.tg, a.timeout_s),
               "this": lambda: engine_tg(ROOT, a.threads, a.tg, a.timeout_s)}
    if a.baseline_tree:
        base = Path(a.baseline_tree).resolve()
        runners["baseline"] = lambda: engine_tg(base, a.threads, a.tg, a.timeout_s)
    runs: dict[str, list[dict]] = {k: [] for k in runners}
    for r in range(a.rounds):
        for name, fn in runners.items():
            before, t = _load(), time.monotonic()
            res = fn()
            res.update(load_before=round(before, 2), load_after=round(_load(), 2), seconds=round(time.monotonic() - t, 1))
            runs[name].append(res)
            print(f"round {r} {name:10s} tg{a.tg} {res['tok_s']:7.2f} tok/s  (load {before:.1f} -> {_load():.1f})",
                  flush=True)
    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in runs.items()}
    summary = {"threads": a.threads, "tg": a.tg, "rounds": a.rounds, "gguf": gguf.name,
               "median_tok_s": {k: round(v, 2) for k, v in med.items()},
               "this_over_llama_cpp": round(med["this"] / med["llama.cpp"], 3)}
    if "baseline" in med:
        summary["this_over_baseline"] = round(med["this"] / med["baseline"], 3)
    print(json.dumps(summary))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "runs": runs, "trees": {"this": str(ROOT),
                                                                           "baseline": a.baseline_tree}}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
