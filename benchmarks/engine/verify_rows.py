"""What a draft token costs: the step time of B decoding sequences each verifying k draft tokens (k+1 decode rows
each: backend/engine/spec/), on the default model as served (INT4, fp8 KV), on the caller's thread.

For B in --levels and k in --drafts, `ModelRunner.execute` of a batch whose every sequence carries a k-token verify
chunk (k = 0: a plain decode step) is timed --reps times at a context of --prompt-len tokens; medians. Reported:
ms per step, and the cost of one draft token as a fraction of the plain step (what `speculative.plan` weighs a
draft token against: on a CPU every row is its own matrix-vector work; on a GPU at small batch a row is nearly
free). Writes benchmarks/results/engine.verify_rows.json.

  python -m benchmarks engine.verify_rows [--levels 1,8,32] [--drafts 0,1,2,4,8] [--reps 20] [--prompt-len 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.engine.kv_integrity import served_config
from benchmarks.engine.step import submit_greedy
from benchmarks.harness.results import ROOT, run_stamp, write_result

OUT = ROOT / "benchmarks" / "results" / "engine.verify_rows.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--drafts", default="0,1,2,4,8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    from edgeinfer.backend.engine.engine import LLMEngine
    from edgeinfer.backend.engine.loading import in_fresh_thread
    from edgeinfer.backend.engine.scheduler import ScheduledBatch
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model

    levels = [int(x) for x in a.levels.split(",") if x]
    drafts = [int(x) for x in a.drafts.split(",") if x]
    model = in_fresh_thread(lambda: load_model(ensure_native_default_model()))
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    need = max(levels) * (-(-(a.prompt_len + max(drafts) + 2) // 16) + 1) + 8
    eng = LLMEngine(model, None, served_config(need, max(levels)))
    g = torch.Generator().manual_seed(0)
    seqs = [submit_greedy(eng, f"v{i}", torch.randint(100, 49000, (a.prompt_len,), generator=g).tolist(), 2)
            for i in range(max(levels))]
    while any(s.is_prefilling for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for s in seqs:
        assert eng.blocks.ensure_capacity(s, s.num_computed_tokens + max(drafts) + 1)
    rows: dict = {}
    for b in levels:
        base = None
        for k in drafts:
            times = []
            for _ in range(a.reps):
                batch = ScheduledBatch()
                if k == 0:
                    batch.decodes = seqs[:b]
                else:
                    batch.verifies = [(s, [7] * k) for s in seqs[:b]]
                keep = [s.num_computed_tokens for s in seqs[:b]]
                t = time.perf_counter()
                eng.runner.execute(batch)
                times.append(time.perf_counter() - t)
                for s, n in zip(seqs[:b], keep):
                    s.num_computed_tokens = n          # the same context every repetition
            ms = statistics.median(times) * 1e3
            base = ms if k == 0 else base
            row = {"ms_per_step": round(ms, 2)}
            if k and base:
                row["draft_token_cost_over_plain_step"] = round((ms - base) / (b * k * base), 3)
            rows[f"{b}x{k}"] = row
            print(f"  {b:3d} sequences x {k} draft tokens: {ms:7.2f} ms" + (
                f"  (a draft token: {row['draft_token_cost_over_plain_step']:.2f} of a plain step)" if k else ""),
                flush=True)
    result = {"bench": "engine.verify_rows", "prompt_len": a.prompt_len, "reps": a.reps,
              "threads": torch.get_num_threads(), "rows": rows}
    result.update(run_stamp(t0, load0))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
