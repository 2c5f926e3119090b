"""Load through the gateway: N concurrent streaming clients for a fixed duration against real backends.

Starts `--backends` backend.server processes (SmolLM2-135M on CPU) and one gateway process on loopback,
then runs `--clients` concurrent streaming chat clients (each its own conversation: a shared system
prompt + its own question, so the prefix cache sees realistic reuse) for `--seconds`, each request with
`--max-tokens` and `ignore_eos`, so a complete answer has exactly max_tokens tokens. Reports:

- completed (200, [DONE], exactly max_tokens tokens), failed (non-200, error event, exception), truncated
  (stream ended without [DONE] or with fewer tokens);
- tokens/s (completion tokens of all requests / wall time), TTFT and ITL percentiles (client side);
- aborted: with --abort-every K, every K-th request of each client disconnects on purpose after its
  first 2 tokens (counted apart; exercises the abort path that must free pages);
- pages leaked: after the run, each backend's `edgeinfer_backend_kv_pages_used` must return to 0
  (polled for up to 10 s); anything left is a leak.

Bounded: clients stop sending at --seconds, in-flight requests get --drain-seconds to finish, and the
whole run is killed at --max-seconds. Loopback only.

  python -m benchmarks serving.load [--backends 2] [--clients 8] [--seconds 60] [--max-tokens 16] [--abort-every 5]

Writes benchmarks/results/serving.load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.results import latency_summary, write_result  # noqa: E402
from benchmarks.harness.servers import ProcessGroup, free_port, wait_http  # noqa: E402

KEY = "sk-bench-load"
SEED = "bench-load-seed"
SYSTEM = ("You are a concise assistant for a travel agency. Answer in one or two short sentences, mention "
          "one concrete place, and never ask follow-up questions.")
QUESTIONS = ["Where should I go for a beach holiday in May?", "What is a good city for a weekend of museums?",
             "Suggest a quiet mountain village.", "Where can I see northern lights?",
             "Which island is good for diving?", "Recommend a place for hiking in autumn.",
             "Where is good street food?", "Suggest a winter city break."]


def finished_by_reason(url: str) -> dict[str, float]:
    import requests

    text = requests.get(url + "/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^edgeinfer_backend_requests_finished_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


def pages_used(url: str) -> float:
    import requests

    m = re.search(r"^edgeinfer_backend_kv_pages_used\{[^}]*\} (\S+)$",
                  requests.get(url + "/metrics", timeout=5).text, re.M)
    return float(m.group(1)) if m else float("nan")


async def client_loop(i: int, gw: str, model: str, args, stats: dict, stop_at: float) -> None:
    import aiohttp

    headers = {"authorization": f"Bearer {KEY}"}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        turn = 0
        while time.monotonic() < stop_at:
            turn += 1
            msgs = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (client {i}, turn {turn})"}]
            body = {"model": model, "messages": msgs, "max_tokens": args.max_tokens, "temperature": 0.7,
                    "seed": i * 1000 + turn, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = last = None
            tokens, done, error, seen = 0, False, None, 0
            abort = args.abort_every > 0 and turn % args.abort_every == 0
            try:
                async with s.post(gw + "/v1/chat/completions", json=body, headers=headers) as r:
                    if r.status != 200:
                        error = f"HTTP {r.status}: {(await r.text())[:200]}"
                    else:
                        buf = b""
                        async for piece in r.content.iter_any():
                            if abort and seen >= 2:
                                break
                            buf += piece
                            while b"\n\n" in buf:
                                if abort and seen >= 2:
                                    break
                                event, buf = buf.split(b"\n\n", 1)
                                data = event[len(b"data: "):]
                                if data == b"[DONE]":
                                    done = True
                                    continue
                                obj = json.loads(data)
                                if "error" in obj:
                                    error = obj["error"].get("code") or "error"
                                    continue
                                now = time.perf_counter()
                                for c in obj.get("choices", []):
                                    if c["delta"].get("content"):
                                        if first is None:
                                            first = now
                                            stats["ttft"].append(now - t0)
                                        elif last is not None:
                                            stats["itl"].append(now - last)
                                        last = now
                                        seen += 1
                                if abort and seen >= 2:
                                    break
                                if obj.get("usage"):
                                    tokens = obj["usage"]["completion_tokens"]
                        if abort and not done:
                            r.close()            # drop the connection: the gateway must abort upstream
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"
            stats["tokens"] += tokens
            if abort and error is None:
                stats["aborted"] += 1
            elif error is not None:
                stats["failed"] += 1
                stats["errors"][error[:120]] = stats["errors"].get(error[:120], 0) + 1
            elif not done or tokens != args.max_tokens:
                stats["truncated"] += 1
            else:
                stats["completed"] += 1
                stats["latency"].append(time.perf_counter() - t0)


async def drive(gw: str, model: str, args) -> dict:
    stats = {"completed": 0, "failed": 0, "truncated": 0, "aborted": 0, "tokens": 0, "ttft": [], "itl": [], "latency": [],
             "errors": {}}
    t0 = time.monotonic()
    stop_at = t0 + args.seconds
    tasks = [asyncio.create_task(client_loop(i, gw, model, args, stats, stop_at)) for i in range(args.clients)]
    done, pending = await asyncio.wait(tasks, timeout=args.seconds + args.drain_seconds)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - t0
    stats["cancelled_at_deadline"] = len(pending)
    stats["wall_s"] = round(wall, 2)
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--drain-seconds", type=float, default=30.0)
    p.add_argument("--max-seconds", type=float, default=240.0, help="hard bound on the whole run")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--abort-every", type=int, default=5,
                   help="every K-th request of a client disconnects after 2 tokens (0: never)")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving.load.json"))
    args = p.parse_args()
    if not 1 <= args.clients <= 256 or not 1 <= args.backends <= 8 or args.seconds > 600:
        p.error("bounded: 1-256 clients, 1-8 backends, at most 600 s")
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("--max-seconds exceeded")))
    signal.alarm(int(args.max_seconds))

    from edgeinfer.backend.model.gguf_import import ensure_default_model
    from edgeinfer.gateway.config import hash_key

    model_dir = ensure_default_model()
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_load_{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = ProcessGroup(log_dir)
    secret = os.urandom(16).hex()   # the gateway's internal secret, shared with the backends through the env
    env = {**os.environ, "EDGEINFER_CACHE_SEED": SEED, "EDGEINFER_INTERNAL_SECRET": secret, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    backends = []
    result: dict = {}
    try:
        for i in range(args.backends):
            port = free_port()
            proc = procs.start(f"backend{i}", [sys.executable, "-m", "edgeinfer.backend.server", "--model", str(model_dir),
                                               "--port", str(port), "--node-id", f"load-{i}", "--num-pages", "512",
                                               "--max-num-seqs", "16", "--store-tier", "none",
                                               "--log-level", "WARNING"], env)
            backends.append((f"http://127.0.0.1:{port}", proc))
        for url, proc in backends:
            wait_http(url + "/ready", proc, 180)
        import requests

        model = requests.get(backends[0][0] + "/internal/info", headers={"authorization": f"Bearer {secret}"},
                             timeout=5).json()["model"]
        gw_port = free_port()
        cfg = log_dir / "gateway.toml"
        nodes = "".join(f'[[nodes]]\nid = "load-{i}"\nurl = "{u}"\nmodel = "{model}"\n\n'
                        for i, (u, _) in enumerate(backends))
        cfg.write_text(f'[server]\nport = {gw_port}\npage_seed = "{SEED}"\naccess_log = false\n'
                       f'health_interval_s = 0.5\n\n[[models]]\nname = "{model}"\ntokenizer = "{model_dir}"\n\n'
                       f'{nodes}[[tenants]]\nid = "bench"\napi_key_sha256 = ["{hash_key(KEY)}"]\n')
        gw = procs.start("gateway", [sys.executable, "-m", "edgeinfer.ops.cli", "gateway", "--config", str(cfg)], env)
        gw_url = f"http://127.0.0.1:{gw_port}"
        wait_http(gw_url + "/ready", gw, 60)

        stats = asyncio.run(drive(gw_url, model, args))
        leaked = {}
        end = time.monotonic() + 10
        for url, _ in backends:
            while pages_used(url) != 0 and time.monotonic() < end:
                time.sleep(0.2)
            leaked[url] = pages_used(url)
        reasons: dict[str, float] = {}
        for url, _ in backends:
            for k, v in finished_by_reason(url).items():
                reasons[k] = reasons.get(k, 0) + v
        total = stats["completed"] + stats["failed"] + stats["truncated"] + stats["aborted"]
        result = {
            "bench": "bench_load", "host": platform.node(), "cpus": os.cpu_count(),
            "loadavg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()], "model": model, "backends": args.backends,
            "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
            "requests": total, "completed": stats["completed"], "failed": stats["failed"],
            "truncated": stats["truncated"], "aborted_by_client": stats["aborted"],
            "abort_every": args.abort_every, "cancelled_at_deadline": stats["cancelled_at_deadline"],
            "errors": stats["errors"], "wall_s": stats["wall_s"],
            "completion_tokens": stats["tokens"], "tokens_per_s": round(stats["tokens"] / stats["wall_s"], 2),
            "requests_per_s": round(stats["completed"] / stats["wall_s"], 3),
            "ttft": latency_summary(stats["ttft"]), "itl": latency_summary(stats["itl"]),
            "request_latency": latency_summary(stats["latency"]),
            "backend_finished_by_reason": reasons, "pages_used_after": leaked, "pages_leaked": sum(leaked.values()),
        }
    finally:
        signal.alarm(0)
        procs.stop()
    write_result(result, args.out)
    ok = result["pages_leaked"] == 0 and result["failed"] == 0 and result["truncated"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
