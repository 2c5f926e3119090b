"""edgeinfer.kernels.cpu (C++ int8-dot kernels) vs torch's CPU int4 GEMM vs fp32 dense (oneDNN-prepacked), per layer
shape of SmolLM2-135M, interleaved round-robin in one process (the box is shared: ratios matter more than
absolutes; the load average is recorded before and after).

  python -m benchmarks kernels.cpu [--rows 1,8,32,64,128,512] [--reps 7] [--threads N]

Methods, each through the module the engine uses:
  ext        W4A16Linear (Q4_1 mins form) on kernels.cpu's interleaved (x8) layout: int8 dots below
             DENSE_MIN_ROWS, dequantize into a scratch buffer + GEMM from it; the head: Q8Linear (x8 Q8_0 x Q8
             int8 dots below HEAD_DENSE_MIN_ROWS, chunked dequantize + GEMM from it)
  ext_int    the x8 int8-dot kernel forced at every row count (to place the threshold), on the best instruction
             set this CPU has (kernels.cpu.x8_isa: AVX-VNNI / AVX512-VNNI where present)
  x8_avx2    the same x8 kernel on its AVX2 (maddubs) level, the pre-VNNI code: bit-identical outputs
  ext_dense  x8 dequantize + GEMM forced at every row count
  old_int    the previous plain-layout int8-dot kernel (q4_1_gemm / q8_0_gemm: one weight row at a time)
  torch_int4 W4A16Linear prepacked for torch._weight_int4pack_mm_for_cpu (the old default)
  fp32       DenseLinear(fp32 weight).prepack() (oneDNN), the dequantized import's path
GB/s at one row = the bytes the method's weight holds / time. Writes benchmarks/results/kernels.cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import edgeinfer.kernels.cpu as kc  # noqa: E402
from edgeinfer.backend.model.linear import HEAD_CHUNK, DenseLinear, Q8Linear, W4A16Linear  # noqa: E402
from edgeinfer.backend.model.packing import group_dequantize_mins  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kernels.cpu.json"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def q4_layer(n: int, k: int, mode: str) -> W4A16Linear:
    q, s, m = _raw(n, k)
    lin = W4A16Linear(q, s, None, 32, mins=m)
    os.environ[kc.MODE_ENV] = mode
    assert lin.prepack() and (lin.q4_1x8 is not None) == (mode == "ext"), mode
    return lin


class on_avx2:   # noqa: N801
    """fn on the x8 kernels' AVX2 level: the timing loop selects it around the (timed) call."""

    isa = 0

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def timed_at_isa(fn, x: torch.Tensor) -> float:
    isa = getattr(fn, "isa", None)
    if isa is None:
        return timed(fn, x)
    best = kc.x8_isa()
    kc.x8_isa(isa)
    try:
        return timed(fn, x)
    finally:
        kc.x8_isa(best)


def methods(name: str, n: int, k: int) -> dict:
    g = torch.Generator().manual_seed(7)
    if name == "head":
        qw = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        sc = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        dense = DenseLinear((qw.float().reshape(n, -1, 32) * sc.float()[..., None]).reshape(n, k))
        dense.prepack()
        head = Q8Linear.from_plain(qw, sc)
        qs, d = head.qs, head.d
        nbytes = head.weight_bytes()
        return {"ext": (head, nbytes), "ext_int": (lambda x: kc.q8_0x8_gemm(x, qs, d, n), nbytes),
                "x8_avx2": (on_avx2(lambda x: kc.q8_0x8_gemm(x, qs, d, n)), nbytes),
                "ext_dense": (lambda x: torch.cat([x @ kc.q8_0x8_dequant(qs, d, r, kc.scratch(min(HEAD_CHUNK, n - r),
                                                                                             k)).t()
                                                   for r in range(0, n, HEAD_CHUNK)], dim=1), nbytes),
                "old_int": (lambda x: kc.q8_0_gemm(x, qw, sc), nbytes),
                "fp32": (dense, n * k * 4)}
    ext, old = q4_layer(n, k, "ext"), q4_layer(n, k, "torch")
    packed = ext.q4_1x8
    assert packed is not None
    blocks = kc.pack_q4_1(*_raw(n, k), 32)
    dense = DenseLinear(group_dequantize_mins(*_raw(n, k), 32))
    dense.prepack()
    nbytes = packed.numel()
    return {"ext": (ext, nbytes),
            "ext_int": (lambda x: kc.q4_1x8_gemm(x, packed, n), nbytes),
            "x8_avx2": (on_avx2(lambda x: kc.q4_1x8_gemm(x, packed, n)), nbytes),
            "ext_dense": (lambda x: x @ kc.q4_1x8_dequant(packed, n, kc.scratch(n, k)).t(), nbytes),
            "old_int": (lambda x: kc.q4_1_gemm(x, blocks), nbytes),
            "torch_int4": (old, old.int4pack.numel() + old.scales_and_zeros.numel() * 2),  # type: ignore[union-attr]
            "fp32": (dense, n * k * 4)}


def _raw(n: int, k: int):
    g = torch.Generator().manual_seed(n + k)
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
            (torch.rand(n, k // 32, generator=g) * 0.02).half(), (-torch.rand(n, k // 32, generator=g) * 0.1).half())


def timed(fn, x: torch.Tensor) -> float:
    t = time.perf_counter()
    fn(x)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32, 64, 128, 512])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    kc.ops()
    load_before = os.getloadavg()
    rows = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            ms = methods(name, n, k)
            for m in a.rows:
                if name == "head" and m > 64:
                    continue                     # the runner computes the head for each sequence's last token only
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                times: dict[str, list[float]] = {key: [] for key in ms}
                reps = a.reps if m * n <= 64 * 3072 else max(3, a.reps // 2)
                for fn, _ in ms.values():
                    timed_at_isa(fn, x)                                         # warm
                for _ in range(reps):                                           # interleaved round-robin
                    for key, (fn, _) in ms.items():
                        times[key].append(timed_at_isa(fn, x))
                row = {"layer": name, "n": n, "k": k, "rows": m}
                for key, (_, nbytes) in ms.items():
                    t = statistics.median(times[key])
                    row[f"{key}_ms"] = round(t * 1e3, 4)
                    if m == 1:
                        row[f"{key}_gb_s"] = round(nbytes / t / 1e9, 2)
                base = row.get("torch_int4_ms", row["fp32_ms"])
                row["ext_speedup_vs_torch_int4" if "torch_int4_ms" in row else "ext_speedup_vs_fp32"] = \
                    round(base / row["ext_ms"], 2)
                row["x8_speedup_vs_old_int"] = round(row["old_int_ms"] / row["ext_int_ms"], 2)
                row["isa_speedup_vs_avx2"] = round(row["x8_avx2_ms"] / row["ext_int_ms"], 2)
                row["x8_int_over_dense"] = round(row["ext_dense_ms"] / row["ext_int_ms"], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "x8_isa": kc.ISA_NAMES[kc.x8_isa()],
              "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "reps": a.reps,
              "command": "python -m benchmarks kernels.cpu " + " ".join(sys.argv[1:]), "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
