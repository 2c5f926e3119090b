"""Times q8_0x8_gemm (plain: no exact channels) at 1 and 32 rows on a 49152 x 576 table, from one built
edgeinfer_cpu_q4 extension, to compare two builds in separate processes (their ops share a namespace), e.g.
main's q4.cpp vs this branch's (docs/notes/ppl.md).

  OMP_NUM_THREADS=1 python benchmarks/head_op_so.py <TORCH_EXTENSIONS_DIR>/edgeinfer_cpu_q4/edgeinfer_cpu_q4.so LABEL
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main() -> int:
    torch.ops.load_library(sys.argv[1])
    op = torch.ops.edgeinfer_cpu
    g = torch.Generator().manual_seed(0)
    n, k = 49152, 576
    qs = torch.randint(-127, 128, (n // 8, k // 32 * 256), dtype=torch.int8, generator=g)
    d = (torch.rand(n // 8, k // 32 * 8, generator=g) * 0.01).half()
    out = {}
    for m, reps in ((1, 300), (32, 40)):
        x = torch.randn(m, k, generator=g)
        op.q8_0x8_gemm(x, qs, d, n)
        t = []
        for _ in range(reps):
            s = time.perf_counter()
            op.q8_0x8_gemm(x, qs, d, n)
            t.append(time.perf_counter() - s)
        out[m] = {"min_ms": round(min(t) * 1e3, 3), "median_ms": round(statistics.median(t) * 1e3, 3)}
    print(sys.argv[2], out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
