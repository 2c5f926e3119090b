"""Gateway overhead, measured side by side in one run: the same client calls a backend stub directly
(POST /internal/generate) and through the gateway (POST /v1/chat/completions -> the same stub).

The stub answers at once (one token + usage), so the difference is the gateway: auth, validation,
rate limit, chat template + tokenization, page hashes, index lookup, routing, proxying, response.
Each server is its own process; the gateway is pinned to one core. Loopback only, bounded time.
Every gateway request has its own user message (same system prompt), so no cache sees a repeat
of the whole prompt. CPU per request is the gateway process's CPU time / requests (/proc), so it
stays meaningful on a shared machine where latency does not.

  python -m benchmarks serving.gateway [--rate 500] [--seconds 6] [--max-seconds 4] [--concurrency 64]
      [--redis --out benchmarks/results/serving.gateway.redis.json]

With --redis the gateway runs as one of many would: rate limits (Lua GCRA), the concurrent-stream cap
(lease ZSET) and the prefix index go through a local valkey-server (on the stub's core).

Writes benchmarks/results/serving.gateway.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.results import percentile  # noqa: E402
from benchmarks.harness.servers import free_port, wait_http  # noqa: E402

MODEL = "bench-model"
KEY = "sk-bench"
MSGS = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write one short sentence about the sea."}]



def _pin(core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


# ---- roles run in subprocesses ----------------------------------------------------------------

def run_stub(port: int) -> None:
    import uvloop
    from aiohttp import web

    from edgeinfer.protocol.wire import BackendInfo, StreamChunk, Usage, encode, request_decoder

    async def generate(request: web.Request) -> web.Response:
        req = request_decoder.decode(await request.read())
        body = encode(StreamChunk(req.request_id, [42], " Hi", finish_reason="length",
                                  usage=Usage(len(req.prompt_token_ids), 1, 0))) + b"\n"
        return web.Response(body=body, content_type="application/x-ndjson")

    info = encode(BackendInfo("stub-0", MODEL, "fp", "fp16", 16, 4096, "1", "active"))
    app = web.Application()
    app.router.add_post("/internal/generate", generate)
    app.router.add_post("/internal/abort", lambda r: web.json_response({"aborted": False}))
    app.router.add_get("/internal/info", lambda r: web.Response(body=info, content_type="application/json"))
    app.router.add_get("/ready", lambda r: web.Response(text="ok"))
    app.router.add_get("/health", lambda r: web.Response(text="ok"))
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def run_gateway(port: int, stub_port: int, tokenizer_dir: str, redis_url: str = "") -> None:
    from edgeinfer.gateway import config as config_mod
    from edgeinfer.gateway.cli import run_loop, serve_gateway

    logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"))  # access log on, written to /dev/null
    cfg = config_mod.parse({
        "server": {"port": port, "health_interval_s": 1.0, "redis_url": redis_url},
        "models": [{"name": MODEL, "tokenizer": tokenizer_dir}],
        "nodes": [{"id": "stub-0", "url": f"http://127.0.0.1:{stub_port}", "model": MODEL}],
        "tenants": [{"id": "bench", "api_key_sha256": [config_mod.hash_key(KEY)], "requests_per_min": 10_000_000,
                     "tokens_per_min": 1_000_000_000, "max_concurrent_streams": 10_000}]})
    run_loop(serve_gateway(cfg))


# ---- load generation ----------------------------------------------------------------------------


def _chat_body(i: int) -> bytes:
    import msgspec

    msgs = [MSGS[0], {"role": "user", "content": f"{MSGS[1]['content']} Request {i}."}]
    return msgspec.json.encode({"model": MODEL, "messages": msgs, "max_tokens": 1})


async def _one(session, url: str, body: bytes, headers: dict) -> float:
    t = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - t


async def fixed_rate(session, url, bodies, headers, rate: float, seconds: float) -> dict:
    """Open loop: a request every 1/rate s regardless of completions; latency per request."""
    n = int(rate * seconds)
    start = time.perf_counter() + 0.05
    lat: list[float] = []

    async def fire(i: int) -> None:
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lat.append(await _one(session, url, bodies[i % len(bodies)], headers))

    await asyncio.gather(*(fire(i) for i in range(n)))
    achieved = n / (time.perf_counter() - start)
    return {"requests": n, "achieved_rps": round(achieved, 1), "p50_ms": round(percentile(lat, 50) * 1e3, 3),
            "p99_ms": round(percentile(lat, 99) * 1e3, 3), "max_ms": round(max(lat) * 1e3, 3)}


async def max_throughput(session, url, bodies, headers, concurrency: int, seconds: float) -> dict:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await _one(session, url, bodies[done % len(bodies)], headers)
            done += 1

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"requests": done, "rps": round(done / (time.perf_counter() - t), 1), "concurrency": concurrency}


def _cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def _cpu_s(pid: int) -> float:
    return sum(_cpu_split(pid))


async def measure(args, gw_port: int, stub_port: int, tokenizer_dir: str, pids: dict[str, int]) -> dict:
    import aiohttp
    import msgspec

    from edgeinfer.protocol.tokenizer import Tokenizer
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    prompt = Tokenizer.from_dir(tokenizer_dir).encode_chat(MSGS)
    direct_body = msgspec.json.encode(GenerateRequest("bench", prompt, SamplingParams(max_tokens=1), "ns", MODEL))
    n_fixed = int(args.rate * args.seconds)
    gw_bodies = [_chat_body(i) for i in range(200 + n_fixed + int(20_000 * args.max_seconds))]
    gw_hdr = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    gw_url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
    # name -> (url, headers, warm-up bodies, fixed-rate bodies, max-throughput bodies)
    targets = {
        "direct": (f"http://127.0.0.1:{stub_port}/internal/generate", {"content-type": "application/json"},
                   [direct_body], [direct_body], [direct_body]),
        "gateway": (gw_url, gw_hdr, gw_bodies[:200], gw_bodies[200:200 + n_fixed], gw_bodies[200 + n_fixed:]),
    }
    out: dict = {"prompt_tokens": len(prompt)}
    conn = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=conn) as session:
        for url, headers, warm, _, _ in targets.values():  # warm-up: connections, caches
            await asyncio.gather(*(_one(session, url, warm[i % len(warm)], headers) for i in range(200)))
        for name, (url, headers, _, bodies, _) in targets.items():
            gw0 = _cpu_s(pids["gateway"])
            r = out[f"{name}_fixed_rate"] = await fixed_rate(session, url, bodies, headers, args.rate, args.seconds)
            if name == "gateway":
                r["gateway_cpu_us_per_request"] = round((_cpu_s(pids["gateway"]) - gw0) / r["requests"] * 1e6, 1)
        for name, (url, headers, _, _, bodies) in targets.items():
            gw0, stub0, split0 = _cpu_s(pids["gateway"]), _cpu_s(pids["stub"]), _cpu_split(pids["gateway"])
            r = out[f"{name}_max"] = await max_throughput(session, url, bodies, headers, args.concurrency,
                                                          args.max_seconds)
            r["stub_cpu_us_per_request"] = round((_cpu_s(pids["stub"]) - stub0) / r["requests"] * 1e6, 1)
            if name == "gateway":
                r["gateway_cpu_us_per_request"] = round((_cpu_s(pids["gateway"]) - gw0) / r["requests"] * 1e6, 1)
                split1 = _cpu_split(pids["gateway"])
                r["gateway_user_us_per_request"] = round((split1[0] - split0[0]) / r["requests"] * 1e6, 1)
                r["gateway_sys_us_per_request"] = round((split1[1] - split0[1]) / r["requests"] * 1e6, 1)
    return out


def _tokenizer_dir() -> str:
    try:
        from edgeinfer.backend.model.gguf_import import ensure_default_model

        return str(ensure_default_model())
    except Exception as e:  # no default model available: fall back to a byte-level tokenizer
        print(f"default model unavailable ({e}); using a byte-level tokenizer", file=sys.stderr)
        import tempfile

        from tokenizers import Tokenizer, models, pre_tokenizers

        d = Path(tempfile.mkdtemp())
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                   merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template":
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"}))
        return str(d)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["stub", "gateway"])
    p.add_argument("--port", type=int)
    p.add_argument("--stub-port", type=int)
    p.add_argument("--tokenizer")
    p.add_argument("--core", type=int)
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--max-seconds", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--redis", action="store_true",
                   help="start a valkey-server on the stub's core and give the gateway redis_url: rate limits, "
                        "the concurrent-stream cap and the prefix index then go through Redis, as with many gateways")
    p.add_argument("--redis-url", default="", help=argparse.SUPPRESS)   # set by the parent for the gateway role
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving.gateway.json"))
    args = p.parse_args()
    if args.role:
        _pin(args.core)
        if args.role == "stub":
            run_stub(args.port)
        else:
            run_gateway(args.port, args.stub_port, args.tokenizer, args.redis_url)
        return 0
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    gw_core = cores[0]
    other = cores[1] if len(cores) > 1 else cores[0]
    tok_dir = _tokenizer_dir()
    stub_port, gw_port = free_port(), free_port()
    me = [sys.executable, "-m", "benchmarks.serving.gateway"]
    valkey = None
    if args.redis:
        from tests.support.redis_server import ValkeyServer

        valkey = ValkeyServer().start()
        if valkey.proc is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(valkey.proc.pid, {other})
    procs = [subprocess.Popen([*me, "--role", "stub", "--port", str(stub_port), "--core", str(other)]),
             subprocess.Popen([*me, "--role", "gateway", "--port", str(gw_port), "--stub-port", str(stub_port),
                               "--tokenizer", tok_dir, "--core", str(gw_core),
                               "--redis-url", valkey.url if valkey else ""], stdout=subprocess.DEVNULL)]
    try:
        _pin(other)
        wait_http(f"http://127.0.0.1:{stub_port}/ready")
        wait_http(f"http://127.0.0.1:{gw_port}/ready")
        import uvloop

        res = uvloop.run(measure(args, gw_port, stub_port, tok_dir,
                                 {"stub": procs[0].pid, "gateway": procs[1].pid}))
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            pr.wait(timeout=30)
        if valkey is not None:
            valkey.stop()
    d, g = res["direct_fixed_rate"], res["gateway_fixed_rate"]
    res["added_p50_ms"] = round(g["p50_ms"] - d["p50_ms"], 3)
    res["added_p99_ms"] = round(g["p99_ms"] - d["p99_ms"], 3)
    res["max_rps_ratio_gateway_over_direct"] = round(res["gateway_max"]["rps"] / res["direct_max"]["rps"], 3)
    res["goal"] = {"added_p99_ms_max": 2.0, "at_rps": args.rate,
                   "met": res["added_p99_ms"] <= 2.0 and g["achieved_rps"] >= 0.95 * args.rate}
    res["setup"] = {"gateway_core": gw_core, "stub_and_client_core": other, "cpus": len(cores),
                    "python": platform.python_version(), "rate": args.rate, "seconds": args.seconds,
                    "max_seconds": args.max_seconds, "concurrency": args.concurrency, "tokenizer": tok_dir,
                    "user_message": "distinct per request", "event_loop": "uvloop",
                    "redis": bool(args.redis)}
    print(f"at {args.rate:.0f} req/s: direct p50 {d['p50_ms']:.3f} ms p99 {d['p99_ms']:.3f} ms | "
          f"gateway p50 {g['p50_ms']:.3f} ms p99 {g['p99_ms']:.3f} ms | "
          f"added p50 {res['added_p50_ms']:.3f} ms p99 {res['added_p99_ms']:.3f} ms (goal <= 2 ms: "
          f"{'met' if res['goal']['met'] else 'NOT met'}); gateway CPU {g['gateway_cpu_us_per_request']:.0f} us/request")
    cpu = res["gateway_max"]["gateway_cpu_us_per_request"]
    res["gateway_cpu_bound_rps_one_core"] = round(1e6 / cpu, 1)
    print(f"max req/s: direct {res['direct_max']['rps']:.0f}, gateway {res['gateway_max']['rps']:.0f} "
          f"(ratio {res['max_rps_ratio_gateway_over_direct']:.2f}, gateway on 1 core); gateway CPU "
          f"{cpu:.0f} us/request -> {1e6 / cpu:.0f} req/s per core if it had the core to itself")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    res["setup_loadavg_1m"] = load
    print(f"(1-min load average during the run: {load:.2f} on {len(cores)} CPUs)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
