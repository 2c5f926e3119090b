"""What the contended step budget (EngineConfig.contended_step_tokens) costs the flooding tenant: the engine
in-process (one thread, as the benchmark's backend), a fixed batch of A requests (bench_fairness's unique
~120-word prompts), timed from submission until the last one ends, per cap. Contention is held on throughout by
one short B request served first with a window longer than the run (B's closed-loop client "between requests");
cap 0 is the uncapped step; the caps are fixed (contended_step_ratio 0). --ratios adds engines whose cap is
derived from the measured step cost (contended_step_ratio r, the default 1.0; the default fixed cap until the first fit,
i.e. the first ~30 steps of the first rep); their entries report the cap in force at the end and the fit. Caps
and ratios run interleaved, --reps times each, and the median is reported, so a neighbour's load on a shared
box hits every one alike.

  python -m benchmarks fairness.contended_cost [--requests 32] [--caps 0,32,64,128] [--ratios 1.0] [--reps 3]

Writes benchmarks/results/fairness.contended_cost.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import itertools  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.fairness.tenants import B_SYSTEM, WORDS  # noqa: E402
from benchmarks.harness.results import run_stamp, write_result  # noqa: E402

_ids = itertools.count()


def _req(eng, tenant, msgs, max_tokens: int):
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    return GenerateRequest(f"{tenant.id}{next(_ids)}", eng.tokenizer.encode_chat(msgs),
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           f"tenant:{tenant.id}", tenant=tenant)


async def _run(eng, args, rep: int) -> dict:
    from edgeinfer.protocol.wire import TenantSpec

    a, b = TenantSpec("a"), TenantSpec("b")
    async for _ in eng.generate(_req(eng, b, [{"role": "system", "content": B_SYSTEM},
                                              {"role": "user", "content": "Can I rent a cargo bike?"}], 2)):
        pass
    rng = random.Random(rep)
    reqs = [_req(eng, a, [{"role": "user", "content": f"{i}: summarize: "
                           + " ".join(rng.choice(WORDS) for _ in range(args.a_prompt_words))}], args.max_tokens)
            for i in range(args.requests)]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    steps0 = eng.steps
    t0 = time.perf_counter()

    async def one(r) -> int:
        n = 0
        async for c in eng.generate(r):
            n += len(c.token_ids)
        return n

    out = await asyncio.gather(*[one(r) for r in reqs])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "prompt_tokens": prompt_tokens, "completion_tokens": sum(out),
            "steps": eng.steps - steps0, "contended_steps": getattr(eng.scheduler, "num_contended_steps", 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--a-prompt-words", type=int, default=120)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--caps", default="0,32,64,128")
    p.add_argument("--ratios", default="", help="contended_step_ratio values to add (derived caps), e.g. 1.0")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fairness.contended_cost.json"))
    args = p.parse_args()
    if args.requests > 128 or args.reps > 5:
        p.error("bounded: at most 128 requests, 5 reps")
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine
    from edgeinfer.backend.model.gguf_import import ensure_default_model

    caps: list[str] = [c for c in args.caps.split(",") if c] + [f"ratio={r}" for r in args.ratios.split(",") if r]
    load0 = os.getloadavg()
    t0 = time.monotonic()
    engines = {}
    for cap in caps:
        budget = ({"contended_step_ratio": float(cap[6:])} if cap.startswith("ratio=")       # default fixed cap
                  else {"contended_step_tokens": int(cap), "contended_step_ratio": 0.0})
        cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           contended_window_s=1e6, enable_prefix_cache=False, **budget)
        engines[cap] = load_engine(ensure_default_model(), cfg)
    runs: dict[str, list[dict]] = {c: [] for c in caps}
    for eng in engines.values():
        eng.start()
    try:
        for rep in range(args.reps):
            for cap in caps:
                runs[cap].append(asyncio.run(_run(engines[cap], args, rep)))
    finally:
        for eng in engines.values():
            eng.stop()
    res = {}
    for cap, rs in runs.items():
        med = statistics.median(r["wall_s"] for r in rs)
        res[cap] = {"wall_s_median": round(med, 3), "walls_s": [round(r["wall_s"], 3) for r in rs],
                    "a_prompt_tokens_per_s": round(rs[0]["prompt_tokens"] / med, 1),
                    "a_completion_tokens_per_s": round(rs[0]["completion_tokens"] / med, 2),
                    "steps": rs[-1]["steps"], "contended_steps_total": rs[-1]["contended_steps"]}
        if cap.startswith("ratio="):
            eng = engines[cap]
            coef = eng.step_cost.coef
            res[cap]["cap_at_end"] = eng.scheduler.contended_cap
            res[cap]["fit_ms"] = None if coef is None else dict(zip(("fixed", "per_decode", "per_prefill_token"),
                                                                    (round(c * 1e3, 4) for c in coef)))
    base = res[caps[0]]["wall_s_median"] if caps[0] == "0" else None
    if base:
        for r in res.values():
            r["a_throughput_vs_uncapped"] = round(base / r["wall_s_median"], 3)
    result = {"bench": "bench_contended_cost", "host": platform.node(), "cpus": os.cpu_count(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "requests": args.requests,
              "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "reps": args.reps, "caps": res,
              **run_stamp(t0, load0)}
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
