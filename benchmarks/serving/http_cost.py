"""What serving through HTTP costs: engine-only decode vs `edgeinfer serve` decode, side by side, per source tree.

  python -m benchmarks serving.http_cost --tree before=/tmp/http_base --tree after=. [--levels 1,8,32] [--max-tokens 48]

For each tree (interleaved when --rounds > 1): the engine alone (benchmarks/harness/served_engine.py in a subprocess, the
backend's own defaults, batched decode at each level) and the same engine behind `edgeinfer serve` (gateway ->
backend -> engine thread) under benchmarks/harness/load.py waves of streaming /v1/completions at each level.
Reported per level: decode tok/s both ways, their ratio (HTTP / engine, the figure of merit), TTFT p50, and
the CPU milliseconds per generated token of each serving process (gateway; backend asyncio thread; backend
engine + OpenMP threads), read from /proc: the CPU figures hold up on a busy machine, the rates do not.
Loopback only; every server is stopped (peer_servers.Running). Writes benchmarks/results/serving.http_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load as peer_load  # noqa: E402
from benchmarks.harness.servers import Running, ServerSpec, free_port, session_pids  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of pid."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def roles(pids: list[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        out[pid] = "backend" if "edgeinfer.backend.server" in cmd else "gateway"
    return out


def cpu_by_role(pids: dict[int, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid, role in pids.items():
        for tid, s in thread_cpu_s(pid).items():
            key = role if role == "gateway" else ("backend_asyncio" if tid == pid else "backend_engine")
            out[key] = out.get(key, 0.0) + s
    return out


def prompts(rnd: random.Random, c: int, n: int) -> list[list[int]]:
    return [[rnd.randrange(100, 49000) for _ in range(n)] for _ in range(c)]


def engine_only(tree: Path, levels: list[int], prompt_len: int, max_tokens: int, env: dict) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.harness.served_engine", "--pp", "16", "--tg", "8", "--reps", "1",
           "--npp", str(prompt_len), "--ntg", str(max_tokens), "--npl", ",".join(map(str, levels))]
    t = time.monotonic()
    r = subprocess.run(cmd, cwd=tree, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                       timeout=1800)
    if r.returncode:
        raise RuntimeError(f"peer_engine in {tree} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"wall_s": round(time.monotonic() - t, 1),
            "levels": {str(b["batch"]): {"decode_tok_s": b["decode_tok_s"], "prefill_tok_s": b["prefill_tok_s"],
                                         "first_token_ms": 1000 * b["batch"] * b["pp"] / b["prefill_tok_s"]}
                       for b in out["batched"]}}


def through_http(tree: Path, levels: list[int], prompt_len: int, max_tokens: int, env: dict, log_dir: Path) -> dict:
    from edgeinfer.gateway.config import DEMO_API_KEY

    port = free_port()
    spec = ServerSpec("edgeinfer", [sys.executable, "-m", "edgeinfer.ops.cli", "serve", "--port", str(port)],
                      {**env, "PYTHONPATH": str(tree)}, port, "/ready", DEMO_API_KEY, cwd=tree)
    rnd = random.Random(0)
    out: dict = {"levels": {}}
    t = time.monotonic()
    with Running(spec, log_dir, 900) as srv:
        assert srv.proc is not None
        asyncio.run(peer_load.wave(spec.url, srv.model, spec.api_key, prompts(rnd, 2, 16), 8, 300))
        who = roles(session_pids(srv.proc.pid))
        for c in levels:
            before, load = cpu_by_role(who), os.getloadavg()[0]
            shots = asyncio.run(peer_load.wave(spec.url, srv.model, spec.api_key, prompts(rnd, c, prompt_len),
                                               max_tokens, 900))
            after = cpu_by_role(who)
            tokens = sum(s.tokens for s in shots)
            out["levels"][str(c)] = {
                "decode_tok_s": peer_load.decode_tok_s(shots), "ttft_p50_ms": peer_load.ttft_p50_ms(shots),
                "tokens": tokens, "loadavg_1m_at_start": load, "problems": peer_load.check(shots, max_tokens),
                "cpu_ms_per_token": {k: round(1000 * (after[k] - before.get(k, 0.0)) / max(tokens, 1), 3)
                                     for k in sorted(after)}}
            print(f"  {tree.name} http {c}: {out['levels'][str(c)]}", file=sys.stderr, flush=True)
    out["wall_s"] = round(time.monotonic() - t, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="LABEL=PATH of a source tree (repeatable)")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving.http_cost.json")
    a = ap.parse_args()
    trees = [(label, Path(path).resolve()) for label, _, path in (t.partition("=") for t in a.tree)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    log_dir = Path("/tmp") / f"bench_http_{os.getpid()}"
    log_dir.mkdir(exist_ok=True)
    runs: list[dict] = []
    t0 = time.monotonic()
    for r in range(a.rounds):
        for label, tree in trees:
            load = os.getloadavg()
            eng = engine_only(tree, a.levels, a.prompt_len, a.max_tokens, env)
            print(f"  {label} engine: {eng}", file=sys.stderr, flush=True)
            http = through_http(tree, a.levels, a.prompt_len, a.max_tokens, env, log_dir)
            ratio = {c: (http["levels"][c]["decode_tok_s"] or 0) / eng["levels"][c]["decode_tok_s"]
                     for c in http["levels"] if c in eng["levels"]}
            runs.append({"round": r, "tree": label, "path": str(tree), "loadavg_at_start": load,
                         "engine": eng, "http": http, "http_over_engine": ratio})
    result = {"bench": "bench_http", "command": " ".join(sys.argv), "cpus": os.cpu_count(),
              "threads": a.threads, "levels": a.levels, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
              "loadavg_1_5_15_at_end": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1), "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    for run in runs:
        print(run["tree"], {c: round(x, 3) for c, x in run["http_over_engine"].items()},
              {c: v["cpu_ms_per_token"] for c, v in run["http"]["levels"].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
