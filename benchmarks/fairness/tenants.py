"""Tenant fairness through the real gateway + backend: a flooding tenant A at 8x the concurrency of tenant B.

For each mode (--modes: scheduler:eviction[:backend flag[=value]...]; by default fifo/lru, plain VTC (fair
without preemption for fairness, prefill isolation nor the contended step cap), fair with preemption and
isolation but no contended cap (ARCHITECTURE.md, "Tenant fairness"), and fair with the backend defaults (contended step cap
on)) one backend process (SmolLM2-135M on CPU) and one gateway process on loopback are
started, one untimed B request warms B's shared prefix and the engine, then two phases run:

- solo:  B alone, `--b-clients` streaming clients for `--seconds`;
- flood: A with 8 x b-clients clients plus the same B clients, for `--seconds`.

The first `--drop-first` requests of every client are left out of the TTFT figures, in both phases and every
mode (a client's first request opens its connection, and in the flood phase all clients start at once).

B's requests share a long system prompt (its hot prefix); A's prompts are unique and long, so under LRU A's
flood evicts B's prefix from the small KV pool (`--num-pages`). Reports per phase: B's TTFT p50/p90/p99
(client side), B's completion tokens/s, B's prefix-cache hit rate (usage cached_tokens / prompt_tokens), A's
TTFT and tokens/s; per mode B's flood/solo TTFT ratios at p50, p90 and p99 (the goal: p99 <= 1.5 with fair).

Bounded: phases end at --seconds (in-flight requests get --drain-seconds), the whole run is killed at
--max-seconds. The machine these numbers come from is shared (2 cores, other jobs running): absolute times
are noisy; compare the ratios measured side by side in one run, and read the load averages (per mode).

  python -m benchmarks fairness.tenants [--b-clients 2] [--seconds 25] [--max-tokens 16]

Writes benchmarks/results/fairness.tenants.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import latency_summary, run_stamp, write_result  # noqa: E402
from benchmarks.harness.servers import ProcessGroup, free_port, wait_http  # noqa: E402

KEYS = {"a": "sk-bench-fair-a", "b": "sk-bench-fair-b"}
SEED = "bench-fairness-seed"
B_SYSTEM = ("You are the support assistant of a small bicycle shop in Utrecht. The shop sells city bikes, cargo "
            "bikes and e-bikes, repairs every brand, rents bikes by the day and week, and is open Monday to "
            "Saturday from nine to six. Answer in one short sentence, be friendly, never invent prices, and point "
            "customers to the shop for anything you cannot answer. Repairs take two working days; rentals need "
            "an ID; e-bike batteries are checked for free.")
WORDS = ("river stone window garden signal copper lantern harbor meadow violet engine paper orbit candle "
         "tunnel marble falcon thunder ribbon cactus glacier pepper saddle velvet").split()


async def client(tenant: str, i: int, gw: str, model: str, args, stats: dict, stop_at: float,
                 turns: int | None = None) -> None:
    import aiohttp

    rng = random.Random(hash((tenant, i)) & 0xFFFF)
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as s:
        turn = 0
        while time.monotonic() < stop_at and (turns is None or turn < turns):
            turn += 1
            if tenant == "b":
                msgs = [{"role": "system", "content": B_SYSTEM},
                        {"role": "user", "content": f"Question {i}-{turn}: can I rent a cargo bike?"}]
            else:
                text = " ".join(rng.choice(WORDS) for _ in range(args.a_prompt_words))
                msgs = [{"role": "user", "content": f"{i}-{turn}: summarize: {text}"}]
            body = {"model": model, "messages": msgs, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = None
            usage = None
            try:
                async with s.post(gw + "/v1/chat/completions", json=body, headers=headers) as r:
                    if r.status != 200:
                        stats["failed"] += 1
                        continue
                    buf = b""
                    async for piece in r.content.iter_any():
                        buf += piece
                        while b"\n\n" in buf:
                            event, buf = buf.split(b"\n\n", 1)
                            data = event[len(b"data: "):]
                            if data == b"[DONE]":
                                continue
                            obj = json.loads(data)
                            if first is None and any(c["delta"].get("content") for c in obj.get("choices", [])):
                                first = time.perf_counter() - t0
                            usage = obj.get("usage") or usage
            except (TimeoutError, aiohttp.ClientError, ValueError):
                stats["failed"] += 1
                continue
            if first is None or usage is None:
                stats["failed"] += 1
                continue
            if turn > args.drop_first:
                stats["ttft"].append(first)
            else:
                stats["dropped"] += 1
            stats["tokens"] += usage["completion_tokens"]
            stats["prompt_tokens"] += usage["prompt_tokens"]
            stats["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            stats["completed"] += 1


def _new_stats() -> dict:
    return {"completed": 0, "failed": 0, "dropped": 0, "tokens": 0, "prompt_tokens": 0, "cached_tokens": 0, "ttft": []}


async def warm_up(gw: str, model: str, args) -> None:
    """One untimed B request: B's shared system prompt is in the prefix cache before the solo phase starts."""
    stats = _new_stats()
    await client("b", -1, gw, model, args, stats, time.monotonic() + args.request_timeout, turns=1)
    if stats["completed"] != 1:
        raise RuntimeError("the warm-up request failed")


async def phase(gw: str, model: str, args, a_clients: int) -> dict:
    stats = {"a": _new_stats(), "b": _new_stats()}
    t0 = time.monotonic()
    stop_at = t0 + args.seconds
    tasks = [asyncio.create_task(client("b", i, gw, model, args, stats["b"], stop_at)) for i in range(args.b_clients)]
    tasks += [asyncio.create_task(client("a", i, gw, model, args, stats["a"], stop_at)) for i in range(a_clients)]
    _, pending = await asyncio.wait(tasks, timeout=args.seconds + args.drain_seconds)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - t0
    out = {"wall_s": round(wall, 2), "cancelled_at_deadline": len(pending)}
    for name, st in stats.items():
        if name == "a" and not a_clients:
            continue
        out[name] = {"completed": st["completed"], "failed": st["failed"], "ttft_dropped": st["dropped"],
                     "ttft": latency_summary(st["ttft"]),
                     "tokens_per_s": round(st["tokens"] / wall, 2),
                     "prefix_hit_rate": round(st["cached_tokens"] / max(st["prompt_tokens"], 1), 3)}
    return out


def _engine_gauges(text: str) -> dict:
    """The backend's contended-cap figures from its /metrics: capped steps, the last cap, the step-cost fit."""
    out: dict = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == "edgeinfer_backend_contended_steps_total":
            out["contended_steps"] = int(float(line.rsplit(" ", 1)[1]))
        elif name == "edgeinfer_backend_contended_step_prefill_tokens":
            out["last_contended_cap_tokens"] = int(float(line.rsplit(" ", 1)[1]))
        elif name == "edgeinfer_backend_step_cost_seconds":
            part = line.split('part="', 1)[1].split('"', 1)[0]
            out.setdefault("step_cost_ms", {})[part] = round(float(line.rsplit(" ", 1)[1]) * 1e3, 4)
    return out


def run_mode(mode: str, model_dir: Path, args, env: dict, log_dir: Path) -> dict:
    import requests

    from edgeinfer.gateway.config import hash_key

    scheduler, eviction, *flags = mode.split(":")
    procs = ProcessGroup(log_dir)
    try:
        port = free_port()
        be = procs.start(f"backend-{scheduler}", [
            sys.executable, "-m", "edgeinfer.backend.server", "--model", str(model_dir), "--port", str(port),
            "--node-id", f"fair-{scheduler}", "--num-pages", str(args.num_pages), "--max-num-seqs",
            str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--store-tier",
            "none", "--scheduler", scheduler, "--cache-eviction", eviction, "--log-level", "WARNING",
            *(a for f in flags for a in f"--{f}".split("=", 1))], env)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready", be, 180)
        model = requests.get(url + "/internal/info", headers={"authorization": f"Bearer {env['EDGEINFER_INTERNAL_SECRET']}"},
                             timeout=5).json()["model"]
        gw_port = free_port()
        cfg = log_dir / f"gateway-{scheduler}.toml"
        tenants = "".join(f'[[tenants]]\nid = "{t}"\napi_key_sha256 = ["{hash_key(k)}"]\n\n' for t, k in KEYS.items())
        cfg.write_text(f'[server]\nport = {gw_port}\npage_seed = "{SEED}"\naccess_log = false\n'
                       f'health_interval_s = 0.5\nfirst_byte_timeout_s = 300\n\n[[models]]\nname = "{model}"\n'
                       f'tokenizer = "{model_dir}"\n\n[[nodes]]\nid = "fair-{scheduler}"\nurl = "{url}"\n'
                       f'model = "{model}"\n\n{tenants}')
        gw = procs.start(f"gateway-{scheduler}", [sys.executable, "-m", "edgeinfer.ops.cli", "gateway", "--config", str(cfg)], env)
        gw_url = f"http://127.0.0.1:{gw_port}"
        wait_http(gw_url + "/ready", gw, 60)
        load0 = os.getloadavg()
        asyncio.run(warm_up(gw_url, model, args))
        solo = asyncio.run(phase(gw_url, model, args, 0))
        flood = asyncio.run(phase(gw_url, model, args, 8 * args.b_clients))
        engine = _engine_gauges(requests.get(url + "/metrics", timeout=10).text)

        def ratio(q: str) -> float | None:
            a, b = flood["b"]["ttft"][q], solo["b"]["ttft"][q]
            return round(a / b, 2) if a and b else None

        return {"mode": mode, "scheduler": scheduler, "cache_eviction": eviction, "model": model,
                "loadavg_1_5_15": {"start": [round(x, 2) for x in load0],
                                   "end": [round(x, 2) for x in os.getloadavg()]},
                "solo": solo, "flood": flood, "backend_after_flood": engine,
                **{f"b_ttft_{q}_flood_over_solo": ratio(q) for q in ("p50", "p90", "p99")},
                "b_tokens_per_s_flood_over_solo": round(flood["b"]["tokens_per_s"] / max(solo["b"]["tokens_per_s"],
                                                                                         1e-9), 2)}
    finally:
        procs.stop()


def summary_row(m: dict) -> dict:
    """One mode of one run, the figures the medians are taken of."""
    s, f = m["solo"]["b"], m["flood"]["b"]
    return {"solo_p50_ms": s["ttft"]["p50"], "solo_p99_ms": s["ttft"]["p99"], "flood_p50_ms": f["ttft"]["p50"],
            "flood_p99_ms": f["ttft"]["p99"], "p99_ratio": m["b_ttft_p99_flood_over_solo"],
            "p50_ratio": m["b_ttft_p50_flood_over_solo"], "p90_ratio": m.get("b_ttft_p90_flood_over_solo"),
            "flood_p99_over_solo_p50": round(f["ttft"]["p99"] / s["ttft"]["p50"], 2),
            "b_completed_solo": s["completed"], "b_completed_flood": f["completed"],
            "b_hit_rate_solo": s["prefix_hit_rate"], "b_hit_rate_flood": f["prefix_hit_rate"],
            "b_tokens_per_s_solo": s["tokens_per_s"], "b_tokens_per_s_flood": f["tokens_per_s"],
            "a_tokens_per_s_flood": m["flood"]["a"]["tokens_per_s"]}


def summarize(runs: list[dict]) -> dict:
    """Medians per mode over several runs of this benchmark with the same settings (solo p99 of a few samples on a
    shared box is mostly other jobs' noise, hence also flood p99 over solo p50)."""
    by_mode: dict[str, list[dict]] = {}
    for r in runs:
        for m in r["modes"]:
            by_mode.setdefault(m.get("mode") or f'{m["scheduler"]}:{m["cache_eviction"]}', []).append(summary_row(m))
    medians = {mode: {k: statistics.median(r[k] for r in rows) if all(r[k] is not None for r in rows) else None
                      for k in rows[0]} | {"runs": len(rows)}
               for mode, rows in by_mode.items()}
    return {"bench": "fairness.tenants summary", "medians": medians, "per_run": by_mode,
            "loadavg_1_5_15_start_end": [[r.get("loadavg_1_5_15_at_start"), r.get("loadavg_1_5_15_at_end")]
                                         for r in runs],
            "commands": [r.get("command") for r in runs]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b-clients", type=int, default=2)
    p.add_argument("--seconds", type=float, default=25.0, help="length of each phase")
    p.add_argument("--drain-seconds", type=float, default=30.0)
    p.add_argument("--max-seconds", type=float, default=600.0, help="hard bound on the whole run")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--a-prompt-words", type=int, default=120)
    p.add_argument("--num-pages", type=int, default=160)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the backend's per-step token budget")
    p.add_argument("--backend-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the backend (and gateway) processes; the clients share the same 2 cores")
    p.add_argument("--drop-first", type=int, default=1,
                   help="requests per client left out of the TTFT figures (both phases, every mode)")
    p.add_argument("--modes", default="fifo:lru,fair:fair:no-fair-preemption:no-prefill-isolation:contended-step-tokens=0,"
                                      "fair:fair:contended-step-tokens=0,fair:fair",
                   help="scheduler:eviction[:backend flag[=value] without --...] per mode, comma-separated")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fairness.tenants.json"))
    p.add_argument("--summarize", nargs="+", metavar="RUN.json", default=None,
                   help="no run: write the per-mode medians over these earlier runs' JSON to --out")
    args = p.parse_args()
    if args.summarize:
        result = summarize([json.loads(Path(f).read_text()) for f in args.summarize])
        write_result(result, args.out, echo=False)
        print(json.dumps(result["medians"], indent=2))
        return 0
    if not 1 <= args.b_clients <= 8 or args.seconds > 120:
        p.error("bounded: 1-8 B clients (A gets 8x), at most 120 s per phase")
    if not 1 <= args.backend_threads <= (os.cpu_count() or 1):
        p.error(f"--backend-threads {args.backend_threads}: expected 1..{os.cpu_count()}")
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("--max-seconds exceeded")))
    signal.alarm(int(args.max_seconds))

    from edgeinfer.backend.model.gguf_import import ensure_default_model

    model_dir = ensure_default_model()
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_fairness_{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "EDGEINFER_CACHE_SEED": SEED, "EDGEINFER_INTERNAL_SECRET": os.urandom(16).hex(),
           "OMP_NUM_THREADS": str(args.backend_threads), "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    load0 = os.getloadavg()
    modes = []
    try:
        for mode in args.modes.split(","):
            modes.append(run_mode(mode, model_dir, args, env, log_dir))
    finally:
        signal.alarm(0)
    result = {"bench": "bench_fairness", "host": platform.node(), "cpus": os.cpu_count(),
              "shared_machine": "2 CPU cores shared with other jobs: absolute times are noisy, compare ratios",
              "backend_threads": args.backend_threads, "b_clients": args.b_clients,
              "a_clients": 8 * args.b_clients, "seconds_per_phase": args.seconds,
              "max_tokens": args.max_tokens, "num_pages": args.num_pages, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "ttft_drop_first_per_client": args.drop_first,
              "warm_up": "one untimed B request before the solo phase",
              "modes": modes, **run_stamp(t0, load0)}
    write_result(result, args.out)
    return 0 if all(m["solo"]["b"]["failed"] == m["flood"]["b"]["failed"] == 0 for m in modes) else 1


if __name__ == "__main__":
    sys.exit(main())
