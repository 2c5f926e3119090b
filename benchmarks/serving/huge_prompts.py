"""/health latency while huge prompts are tokenized (issue 14, item 2), side by side in one run:
the gateway tokenizing long prompts in a thread (`tokenizer_workers = 0`, the old behaviour: `tokenizers`
holds the GIL for the whole encode) and in worker processes (`tokenizer_workers = 2`).

Each mode: a gateway process (SmolLM2's tokenizer, a stub backend process behind it), four ~3.9 MB chat
prompts sent at once (the stub's context is 4096 tokens, so each is tokenized in full and then refused
with 400), /health probed every 10 ms from the first byte sent to the last answer.

  python -m benchmarks serving.huge_prompts [--chars 3900000] [--prompts 4] [--out benchmarks/results/serving.huge_prompts.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks.harness.results import percentile  # noqa: E402
from benchmarks.harness.servers import free_port  # noqa: E402
from benchmarks.serving.gateway import MODEL, run_stub  # noqa: E402

KEY = "sk-bench"
WORDS = "The quick brown fox jumps over the lazy dog 12345, and then some more text! "


def run_gateway(port: int, stub_port: int, workers: int) -> None:
    from edgeinfer.gateway import config as config_mod
    from edgeinfer.gateway.cli import run_loop, serve_gateway

    cfg = config_mod.parse({
        "server": {"port": port, "health_interval_s": 0.5, "max_body_bytes": 5 * 1024 * 1024,
                   "tokenizer_workers": workers, "access_log": False},
        "models": [{"name": MODEL, "tokenizer": "default"}],
        "nodes": [{"id": "stub-0", "url": f"http://127.0.0.1:{stub_port}", "model": MODEL}],
        "tenants": [{"id": "bench", "api_key_sha256": [config_mod.hash_key(KEY)], "max_prompt_chars": 4_000_000}]})
    run_loop(serve_gateway(cfg))


async def _wait_ready(session, url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/ready") as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


async def measure(url: str, chars: int, prompts: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await _wait_ready(session, url)
        bodies = [json.dumps({"model": MODEL, "messages": [{"role": "user", "content":
                                                            (f"{i} " + WORDS * (chars // len(WORDS) + 1))[:chars]}]})
                  .encode() for i in range(prompts)]
        headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
        lat: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                t = time.perf_counter()
                async with session.get(url + "/health") as r:
                    await r.read()
                lat.append(time.perf_counter() - t)
                await asyncio.sleep(0.01)

        async def send(body: bytes) -> tuple[int, str]:
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                return r.status, (await r.json())["error"]["message"] if r.status != 200 else ""

        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(send(b) for b in bodies))
        window = time.perf_counter() - t0
        done.set()
        await prober
    return {"window_s": round(window, 2), "probes": len(lat), "health_p50_ms": round(percentile(lat, 50) * 1e3, 2),
            "health_p99_ms": round(percentile(lat, 99) * 1e3, 2), "health_max_ms": round(max(lat) * 1e3, 2),
            "answers": sorted({f"{s} {m[:60]}" for s, m in answers})}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["stub", "gateway"])
    ap.add_argument("--port", type=int)
    ap.add_argument("--stub-port", type=int)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chars", type=int, default=3_900_000)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/serving.huge_prompts.json"))
    args = ap.parse_args()
    if args.role == "stub":
        run_stub(args.port)
        return 0
    if args.role == "gateway":
        run_gateway(args.port, args.stub_port, args.workers)
        return 0
    # the gateway's tokenizer "default" is the built-in model's import, which the gateway never makes itself
    # (`edgeinfer serve` does, on first start): make it here on a fresh EDGEINFER_HOME
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model

    ensure_native_default_model()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "benchmarks.serving.huge_prompts", "--role", "stub", "--port", str(stub_port)], env=env)
    results = {}
    try:
        for name, workers in (("thread", 0), ("processes", 2)):
            port = free_port()
            gw = subprocess.Popen([sys.executable, "-m", "benchmarks.serving.huge_prompts", "--role", "gateway", "--port", str(port),
                                   "--stub-port", str(stub_port), "--workers", str(workers)], env=env)
            try:
                results[name] = asyncio.run(measure(f"http://127.0.0.1:{port}", args.chars, args.prompts))
            finally:
                gw.terminate()
                gw.wait(30)
            print(name, results[name], flush=True)
    finally:
        stub.terminate()
        stub.wait(30)
    out = {"benchmark": "bench_huge_prompts", "chars": args.chars, "prompts": args.prompts,
           "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_1m": round(os.getloadavg()[0], 1)}, "modes": results,
           "p99_ratio_thread_over_processes": round(results["thread"]["health_p99_ms"]
                                                    / max(results["processes"]["health_p99_ms"], 1e-3), 1)}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
