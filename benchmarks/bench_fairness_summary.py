"""Medians over several bench_fairness.py runs (same settings): per mode, B's TTFT p50/p99 solo and under the
flood, the flood/solo ratios (p50/p90/p99) (also flood p99 over solo p50: solo p99 of a few samples on a shared box is
mostly other jobs' noise), B's prefix hit rate, A's and B's tokens/s; with each run's load average.

  python benchmarks/bench_fairness_summary.py OUT.json RUN.json [RUN.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def row(m: dict) -> dict:
    s, f = m["solo"]["b"], m["flood"]["b"]
    return {"solo_p50_ms": s["ttft"]["p50"], "solo_p99_ms": s["ttft"]["p99"], "flood_p50_ms": f["ttft"]["p50"],
            "flood_p99_ms": f["ttft"]["p99"], "p99_ratio": m["b_ttft_p99_flood_over_solo"],
            "p50_ratio": m["b_ttft_p50_flood_over_solo"], "p90_ratio": m.get("b_ttft_p90_flood_over_solo"),
            "flood_p99_over_solo_p50": round(f["ttft"]["p99"] / s["ttft"]["p50"], 2),
            "b_completed_solo": s["completed"], "b_completed_flood": f["completed"],
            "b_hit_rate_solo": s["prefix_hit_rate"], "b_hit_rate_flood": f["prefix_hit_rate"],
            "b_tokens_per_s_solo": s["tokens_per_s"], "b_tokens_per_s_flood": f["tokens_per_s"],
            "a_tokens_per_s_flood": m["flood"]["a"]["tokens_per_s"]}


def main() -> int:
    out, runs = Path(sys.argv[1]), [json.loads(Path(p).read_text()) for p in sys.argv[2:]]
    by_mode: dict[str, list[dict]] = {}
    for r in runs:
        for m in r["modes"]:
            by_mode.setdefault(m.get("mode") or f'{m["scheduler"]}:{m["cache_eviction"]}', []).append(row(m))
    medians = {mode: {k: statistics.median(r[k] for r in rows) if all(r[k] is not None for r in rows) else None
                       for k in rows[0]} | {"runs": len(rows)}
               for mode, rows in by_mode.items()}
    result = {"bench": "bench_fairness_summary", "medians": medians, "per_run": by_mode,
              "loadavg_1_5_15_start_end": [[r.get("loadavg_1_5_15_at_start"), r["loadavg_1_5_15_at_end"]]
                                           for r in runs],
              "commands": [r["command"] for r in runs]}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(medians, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
