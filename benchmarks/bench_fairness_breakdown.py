"""Where tenant B's TTFT goes under tenant A's flood: the engine in-process (no gateway), the workload of
bench_fairness.py (B: a shared system prompt + a short question, 1 client; A: unique ~80-token prompts,
8 clients), every step and every B request timed by an engine observer.

Per B request the time from arrival to first token is split into:
- step_in_flight: arrival -> the start of the next step (the step running when it arrived must end first);
- slot_wait:      that step start -> the start of the step that admits it (all max_num_seqs slots held);
- prefill:        admission step start -> first token (its prefill steps; their duration grows with what
                  else is in them: A's decodes and A's prefill chunks).
Also per phase: mean step time by batch content, preemptions, and A's tokens/s.

  python benchmarks/bench_fairness_breakdown.py [--seconds 30] [--modes fifo,fair] [--fair-preempt on|off]

Writes benchmarks/results/bench_fairness_breakdown.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_fairness import B_SYSTEM, WORDS  # noqa: E402
from benchmarks.result_file import run_stamp, write_result  # noqa: E402

_ids = itertools.count()


class Tracer:
    def __init__(self) -> None:
        self.steps: list[tuple[float, float, int, int, int, int]] = []   # start, end, dec, a_prefill, b_prefill, b_dec
        self.b: list[dict] = []

    def on_step(self, engine, batch, dt: float) -> None:
        if batch is None:
            return
        end = time.monotonic()
        pre = {"a": 0, "b": 0}
        for s, n in batch.prefills:
            pre[s.tenant.id] += n
        self.steps.append((end - dt, end, len(batch.decodes), pre["a"], pre["b"],
                           sum(1 for s in batch.decodes if s.tenant.id == "b")))

    def on_first_token(self, seq, ttft: float) -> None:
        if seq.tenant.id == "b":
            self.b.append({"arrival": seq.arrival, "admitted": seq.admitted_at, "first": seq.first_token_time,
                           "cached": seq.num_cached_prompt_tokens, "prompt": len(seq.prompt_ids)})

    def on_token(self, seq, itl: float) -> None: ...
    def on_finish(self, seq) -> None: ...
    def on_pages_filled(self, seq, pages) -> None: ...


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)


def breakdown(tr: Tracer, t0: float) -> dict:
    starts = [s[0] for s in tr.steps]
    rows = []
    for r in tr.b:
        if r["arrival"] < t0:
            continue
        nxt = next((s for s in starts if s >= r["arrival"]), r["admitted"])
        adm_step = max((s for s in starts if s <= r["admitted"] + 1e-9), default=r["admitted"])
        rows.append({"ttft": r["first"] - r["arrival"], "step_in_flight": max(0.0, nxt - r["arrival"]),
                     "slot_wait": max(0.0, adm_step - nxt), "prefill": r["first"] - adm_step})
    steps = [s for s in tr.steps if s[0] >= t0]
    kinds: dict[str, list[float]] = {}
    for st, en, dec, ap, bp, _bd in steps:
        k = f"dec{dec}" + ("+Aprefill" if ap else "") + ("+Bprefill" if bp else "")
        kinds.setdefault(k, []).append(en - st)
    out: dict = {"b_requests": len(rows),
                 "b_uncached_prompt_tokens_mean": round(statistics.mean(r["prompt"] - r["cached"] for r in tr.b
                                                                        if r["arrival"] >= t0), 1) if rows else None}
    for k in ("ttft", "step_in_flight", "slot_wait", "prefill"):
        xs = [r[k] for r in rows]
        out[k + "_ms"] = {"mean": round(statistics.mean(xs) * 1000, 1) if xs else None, "p50": _pct(xs, 0.5),
                          "p99": _pct(xs, 0.99)}
    out["steps_ms_by_batch"] = {k: {"n": len(v), "mean": round(statistics.mean(v) * 1000, 1)}
                                for k, v in sorted(kinds.items())}
    return out


async def client(eng, tenant, i: int, args, stop_at: float, counts: dict) -> None:
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    rng = random.Random(hash((tenant.id, i)) & 0xFFFF)
    turn = 0
    while time.monotonic() < stop_at:
        turn += 1
        if tenant.id == "b":
            msgs = [{"role": "system", "content": B_SYSTEM},
                    {"role": "user", "content": f"Question {i}-{turn}: can I rent a cargo bike?"}]
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(args.a_prompt_words))
            msgs = [{"role": "user", "content": f"{i}-{turn}: summarize: {text}"}]
        ids = eng.tokenizer.encode_chat(msgs)
        req = GenerateRequest(f"{tenant.id}{next(_ids)}", ids, SamplingParams(max_tokens=args.max_tokens,
                              temperature=0, ignore_eos=True), f"tenant:{tenant.id}", tenant=tenant)
        async for c in eng.generate(req):
            counts[tenant.id] += len(c.token_ids)


async def phase(eng, args, a_clients: int) -> tuple[float, dict]:
    from edgeinfer.protocol.wire import TenantSpec

    counts = {"a": 0, "b": 0}
    t0 = time.monotonic()
    stop_at = t0 + args.seconds
    tasks = [client(eng, TenantSpec("b"), i, args, stop_at, counts) for i in range(args.b_clients)]
    tasks += [client(eng, TenantSpec("a"), i, args, stop_at, counts) for i in range(a_clients)]
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    return t0, {k: round(v / wall, 2) for k, v in counts.items()}


def run_mode(mode: str, args) -> dict:
    from edgeinfer.backend.engine.config import EngineConfig
    from edgeinfer.backend.engine.engine import load_engine
    from edgeinfer.backend.model.gguf_import import ensure_default_model

    cfg = EngineConfig(num_pages=args.num_pages, max_num_seqs=args.max_num_seqs, scheduler=mode.split(":")[0])
    extra = dict(kv.split("=") for kv in mode.split(":")[1:])
    cfg = replace(cfg, **{k: v.lower() in ("1", "true", "on") if isinstance(getattr(cfg, k), bool)
                          else type(getattr(cfg, k))(v) for k, v in extra.items()})
    eng = load_engine(ensure_default_model(), cfg)
    tr = Tracer()
    eng.observers.append(tr)
    eng.start()
    try:
        out: dict = {"mode": mode}
        for name, a_clients in (("solo", 0), ("flood", 8 * args.b_clients)):
            t0, tps = asyncio.run(phase(eng, args, a_clients))
            out[name] = {"tokens_per_s": tps, **breakdown(tr, t0)}
            tr.b = [r for r in tr.b if r["arrival"] >= time.monotonic()]
        out["preemptions"] = eng.scheduler.num_preemptions
        out["fair_preemptions"] = getattr(eng.scheduler, "num_fair_preemptions", 0)
        p99 = [out[p]["ttft_ms"]["p99"] for p in ("solo", "flood")]
        out["b_ttft_p99_flood_over_solo"] = round(p99[1] / p99[0], 2) if all(p99) else None
        return out
    finally:
        eng.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--b-clients", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--a-prompt-words", type=int, default=60)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--num-pages", type=int, default=96)
    p.add_argument("--modes", default="fifo,fair", help="scheduler[:config_field=value...] per mode, comma-separated")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_fairness_breakdown.json"))
    args = p.parse_args()
    if args.seconds > 300 or not 1 <= args.b_clients <= 8:
        p.error("bounded: at most 300 s per phase, 1-8 B clients")
    t0 = time.monotonic()
    load0 = os.getloadavg()
    modes = [run_mode(m, args) for m in args.modes.split(",")]
    result = {"bench": "bench_fairness_breakdown", "host": platform.node(), "cpus": os.cpu_count(),
              "modes": modes, **run_stamp(t0, load0)}
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
