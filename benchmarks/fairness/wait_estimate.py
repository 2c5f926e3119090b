"""How good is the backend's estimate of a new request's wait for its first token (what --max-queue-wait-s is
checked against, backend.engine.backlog) while the fair scheduler caps contended steps?

The engine in-process (one OpenMP thread, as bench_fairness's backend). First tenant A runs alone (full steps:
the full-step rate is measured and the step-cost fit made); then one short B request with a contended window
longer than the run holds contention on; A submits --requests prompts at once (bench_fairness's ~120-word
ones) and, every --probe-every seconds, one more A request (a probe). At each probe's submission the script
reads both estimates from the same Backlog state: the full-step rate one (what Backlog computed before the
contended cap was taken into account) and the current one (capped steps at their predicted time); then it
measures the probe's actual time to its first token. The probe waits behind A's own queue (a tenant's requests
are served oldest first), which is what the estimate counts.

  python -m benchmarks fairness.wait_estimate [--requests 24] [--probes 5] [--probe-every 1.5]

Writes benchmarks/results/fairness.wait_estimate.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.fairness.contended_cost import _req  # noqa: E402
from benchmarks.fairness.tenants import B_SYSTEM, WORDS  # noqa: E402
from benchmarks.harness.results import run_stamp, write_result  # noqa: E402


async def _first_token(eng, req) -> float:
    t0 = time.perf_counter()
    first = None
    async for c in eng.generate(req):
        if first is None and c.token_ids:
            first = time.perf_counter() - t0
    assert first is not None
    return first


async def _run(eng, args) -> dict:
    from edgeinfer.protocol.wire import TenantSpec

    a, b = TenantSpec("a"), TenantSpec("b")
    rng = random.Random(0)

    def a_req(i: int):
        return _req(eng, a, [{"role": "user", "content": f"{i}: summarize: "
                              + " ".join(rng.choice(WORDS) for _ in range(args.a_prompt_words))}], args.max_tokens)

    for r in range(4):                                  # A alone: full steps (the first two are not measured)
        await asyncio.gather(*[_first_token(eng, a_req(-8 * r - i - 1)) for i in range(8)])
    warm = {"full_step_tok_s": eng.backlog.tok_s, "fit": eng.step_cost.coef}
    await _first_token(eng, _req(eng, b, [{"role": "system", "content": B_SYSTEM},
                                          {"role": "user", "content": "Can I rent a cargo bike?"}], 2))
    flood = [asyncio.create_task(_first_token(eng, a_req(i))) for i in range(args.requests)]
    probes = []
    for k in range(args.probes):
        await asyncio.sleep(args.probe_every)
        req = a_req(1000 + k)
        n = len(req.prompt_token_ids)
        bl = eng.backlog
        est_old, est_new = bl.full_step_wait_s(n), bl.wait_s(n)
        per_step = bl.per_step
        probes.append((asyncio.create_task(_first_token(eng, req)), est_old, est_new, per_step))
    out = []
    for task, est_old, est_new, per_step in probes:
        actual = await task
        out.append({"actual_s": round(actual, 3), "full_step_estimate_s": None if est_old is None else round(est_old, 3),
                    "estimate_s": None if est_new is None else round(est_new, 3), "prefill_per_step": per_step})
    await asyncio.gather(*flood)
    return {"warm": {"full_step_tok_s": None if warm["full_step_tok_s"] is None else round(warm["full_step_tok_s"], 1),
                     "fit_ms": None if warm["fit"] is None else [round(c * 1e3, 3) for c in warm["fit"]]},
            "probes": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--probe-every", type=float, default=1.5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--a-prompt-words", type=int, default=120)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fairness.wait_estimate.json"))
    args = p.parse_args()
    if args.requests > 128 or args.probes > 20 or args.probe_every > 30:
        p.error("bounded: at most 128 requests, 20 probes, 30 s between probes")
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine
    from edgeinfer.backend.model.gguf_import import ensure_default_model

    load0 = os.getloadavg()
    t0 = time.monotonic()
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       contended_window_s=1e6, enable_prefix_cache=False)
    eng = load_engine(ensure_default_model(), cfg)
    eng.start()
    try:
        res = asyncio.run(_run(eng, args))
    finally:
        eng.stop()
    ratios = {k: [round(pr[k] / pr["actual_s"], 2) for pr in res["probes"] if pr[k]]
              for k in ("full_step_estimate_s", "estimate_s")}
    res["estimate_over_actual"] = {k: {"each": v, "median": statistics.median(v) if v else None}
                                   for k, v in ratios.items()}
    result = {"bench": "bench_wait_estimate", "host": platform.node(), "cpus": os.cpu_count(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "requests": args.requests,
              "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, **res, **run_stamp(t0, load0)}
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
