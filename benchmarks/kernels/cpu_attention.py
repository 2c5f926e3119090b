"""The CPU attention ops on fp8 pages against fp32 pages (kernels/cpu/attn.cpp), side by side in one run.

Decode (one query row per sequence) at each context and batch, and prefill (a whole prompt, causal), on pools
shaped like the default model's (3 kv heads, 9 query heads, head_dim 64), 30 calls per timing (a step's layers),
the two dtypes alternated --rounds times (medians). fp8 pages are read in place (e4m3 widened through F16C);
fp32 pages are read in place too, 4x the bytes.

  python -m benchmarks kernels.cpu_attention [--contexts 1024,4096,8192] [--batches 1,8] [--rounds 3]

Writes benchmarks/results/kernels.cpu_attention.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import interleaved, run_stamp, write_result  # noqa: E402

KV_HEADS, HEADS, HEAD_DIM, PAGE, LAYERS = 3, 9, 64, 16, 30


def _pool(dtype, tokens: int, seed: int):
    import torch

    from edgeinfer.kernels.kv_store import kv_store_reference

    pages = -(-tokens // PAGE)
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    ks = vs = None
    if dtype == torch.float8_e4m3fn:
        ks, vs = torch.ones(shape[:3], dtype=torch.bfloat16), torch.ones(shape[:3], dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    n = pages * PAGE
    kv_store_reference(torch.randn(n, KV_HEADS, HEAD_DIM, generator=g), torch.randn(n, KV_HEADS, HEAD_DIM, generator=g),
                       k, v, torch.arange(n), ks, vs)
    return k, v, ks, vs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,8192")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prefill", default="1024,4096", help="prompt lengths for the prefill op")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.cpu_attention.json"))
    a = p.parse_args()
    import torch

    from edgeinfer.kernels.cpu import attn

    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    prefills = [int(x) for x in a.prefill.split(",") if x]
    if max(contexts) * max(batches) > 1 << 17 or (prefills and max(prefills) > 8192):
        p.error("bounded: contexts x batches at most 131072 tokens, prefill at most 8192")
    torch.set_num_threads(a.threads)
    ops = attn._ext()
    t0, load0 = time.monotonic(), os.getloadavg()
    dtypes = {"fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}
    cases = [(c, b) for c in contexts for b in batches]
    pools = {name: _pool(dt, max(max(contexts) * max(batches), max(prefills, default=0)), 0)
             for name, dt in dtypes.items()}
    g = torch.Generator().manual_seed(1)
    times: dict = {name: {f"decode {c}x{b}": [] for c, b in cases} | {f"prefill {n}": [] for n in prefills}
                   for name in dtypes}
    for _, name in interleaved(list(dtypes), a.rounds):
        k, v, ks, vs = pools[name]
        for c, b in cases:
            width = -(-c // PAGE)
            tables = torch.arange(b * width, dtype=torch.int32).view(b, width)
            lens = torch.full((b,), c, dtype=torch.int32)
            q = torch.randn(b, HEADS, HEAD_DIM, generator=g)
            start = time.perf_counter()
            for _ in range(LAYERS):
                ops.decode_attention(q, k, v, tables, lens, HEAD_DIM ** -0.5, ks, vs)
            times[name][f"decode {c}x{b}"].append(time.perf_counter() - start)
        for n in prefills:
            width = -(-n // PAGE)
            tables = torch.arange(width, dtype=torch.int32).view(1, width)
            cu = torch.tensor([0, n], dtype=torch.int32)
            q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
            start = time.perf_counter()
            ops.prefill_attention(q, k, v, tables, cu, torch.tensor([n], dtype=torch.int32), HEAD_DIM ** -0.5, ks, vs)
            times[name][f"prefill {n}"].append((time.perf_counter() - start) * LAYERS)
        print(f"{name}: " + ", ".join(f"{k_} {v_[-1] * 1e3:.1f} ms" for k_, v_ in times[name].items()), flush=True)
    med = {name: {k_: statistics.median(v_) for k_, v_ in t.items()} for name, t in times.items()}
    result = {"bench": "kernels.cpu_attention", "host": platform.node(), "cpus": os.cpu_count(), "threads": a.threads,
              "shape": {"kv_heads": KV_HEADS, "heads": HEADS, "head_dim": HEAD_DIM, "layers_per_timing": LAYERS},
              "seconds_per_30_layers": med, "runs": times,
              "fp8_speedup_over_fp32": {k_: med["fp32"][k_] / med["fp8_e4m3"][k_] for k_ in med["fp32"]},
              **run_stamp(t0, load0)}
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
