"""Prefill/decode disaggregation: do decoding streams keep their pace while long prompts arrive?

  python -m benchmarks disagg [--streams 4] [--stream-tokens 128] [--long 4] [--long-tokens 2048] [--gap-s 1.5]

Two deployments of the default model, each `edgeinfer serve` as a user starts it, on the same cores, one after the
other, each with a fresh EDGEINFER_HOME (an empty page store):
  colocated       `edgeinfer serve --nodes 2`                          two backends with --role both
  disaggregated   `edgeinfer serve --prefill-nodes 1 --decode-nodes 1`  one prefill node, one decode node
The same workload on each, run --rounds times: --streams decoding streams (short prompts, --stream-tokens tokens
each, greedy, ignore_eos) start together; a second later --long prompts of --long-tokens tokens (each unique, so no
cache helps; 4 output tokens) arrive one every --gap-s seconds. Measured from the client (streaming
/v1/completions, every SSE event timed):
  - ITL of the decoding streams: p50 / p99 of the gaps between token events, over every stream;
  - TTFT of the long prompts (send -> first token), p50 / max;
  - throughput: every token the run generated and every prompt token, over the run's wall time.
Ratios disaggregated / colocated are printed and written with the raw runs to benchmarks/results/disagg.json.

Caveat of this machine: two cores. Both deployments run two backend processes on the same two cores, so here a
prefill node's work still takes cycles from the decode node (each engine uses the cores the other leaves free),
and disaggregation cannot show what it does with separate GPUs; what it does show is the scheduling effect (the
decode node never runs a prefill chunk of a long prompt in its own steps) and its costs (the hand-off, the two
hops). The paper projection in the result (`projection`) scales the same mechanism to 8xH200 pools with stated
assumptions; it is arithmetic, not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load  # noqa: E402
from benchmarks.harness.results import run_stamp, write_result  # noqa: E402
from benchmarks.harness.servers import Running, edgeinfer_spec  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "disagg.json"
DEPLOYMENTS = {"colocated": ["--nodes", "2"], "disaggregated": ["--prefill-nodes", "1", "--decode-nodes", "1"]}


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


async def _stream(session, url: str, key: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    return await load.timed_stream(session, url, "/v1/completions", {"authorization": f"Bearer {key}"}, body)


async def workload(url: str, key: str, model: str, a, rng: random.Random) -> dict:
    import aiohttp

    def unique(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=a.timeout_s),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        await _stream(s, url, key, model, unique(32), 4)      # warm-up
        t0 = time.perf_counter()
        streams = [asyncio.ensure_future(_stream(s, url, key, model, unique(48), a.stream_tokens))
                   for _ in range(a.streams)]
        await asyncio.sleep(1.0)
        longs = []
        for _ in range(a.long):
            longs.append(asyncio.ensure_future(_stream(s, url, key, model, unique(a.long_tokens), 4)))
            await asyncio.sleep(a.gap_s)
        done_streams = await asyncio.gather(*streams)
        done_longs = await asyncio.gather(*longs)
        wall = time.perf_counter() - t0
    gaps = [b - a_ for r in done_streams for a_, b in zip(r["times"], r["times"][1:])]
    ttft = [r["times"][0] - r["t0"] for r in done_longs if r["times"]]
    out_tokens = sum(r["usage"].get("completion_tokens", 0) for r in done_streams + done_longs)
    prompt_tokens = sum(r["usage"].get("prompt_tokens", 0) for r in done_streams + done_longs)
    return {"itl_ms_p50": 1e3 * _q(gaps, 0.5), "itl_ms_p99": 1e3 * _q(gaps, 0.99), "itl_ms_max": 1e3 * max(gaps),
            "long_ttft_s_p50": statistics.median(ttft), "long_ttft_s_max": max(ttft), "wall_s": wall,
            "output_tok_s": out_tokens / wall, "tokens_per_s": (out_tokens + prompt_tokens) / wall,
            "completion_tokens": out_tokens, "prompt_tokens": prompt_tokens, "gaps": len(gaps)}


def projection() -> dict:
    """8xH200, GLM-4.6-class MoE (32B active, 355B total, FP8 weights) served with TP8 per pool; arithmetic with
    the assumptions named. Colocated: a decode step that carries a prefill chunk of C tokens costs the decode
    step plus the chunk's compute; disaggregated: decode steps never carry one, prefill runs on its own pool."""
    flops = 8 * 989e12 * 0.4             # 8 GPUs of dense BF16/FP8-class tensor FLOPs at 40 % MFU (assumed)
    hbm = 8 * 4.8e12 * 0.7               # 8 x 4.8 TB/s at 70 % achieved (assumed)
    active = 32e9
    weight_bytes = 355e9                 # FP8 weights, read once per decode step (every expert touched at batch 64)
    batch, ctx = 64, 8192
    kv_bytes_token = 61 * 2 * 8 * 128 * 1   # 61 layers, K+V, 8 KV heads x 128 (GQA), fp8: bytes per token (assumed)
    t_decode = (weight_bytes + batch * ctx * kv_bytes_token) / hbm
    chunk = 8192                          # a chunked-prefill budget that keeps prefill efficient (assumed)
    t_chunk = 2 * active * chunk / flops
    colocated_itl_with_chunk = t_decode + t_chunk
    return {"assumptions": {"gpus": "8xH200 per pool", "model": "GLM-4.6-class MoE: 32B active / 355B total, FP8",
                            "mfu": 0.4, "hbm_efficiency": 0.7, "decode_batch": batch, "context": ctx,
                            "prefill_chunk_tokens": chunk},
            "decode_step_ms": 1e3 * t_decode, "prefill_chunk_ms": 1e3 * t_chunk,
            "colocated_itl_ms_in_a_step_with_a_chunk": 1e3 * colocated_itl_with_chunk,
            "disaggregated_itl_ms": 1e3 * t_decode,
            "itl_ratio_in_such_a_step": t_decode / colocated_itl_with_chunk,
            "kv_handoff_ms_per_4k_prompt_over_400Gbps": 1e3 * 4096 * kv_bytes_token / (400e9 / 8),
            "note": "the p99 ITL of colocated serving is set by the steps that carry prefill chunks; with long "
                    "prompts arriving steadily most steps do. Disaggregated decode steps carry none, at the cost of "
                    "the KV hand-off (per prompt, overlapped with other streams' decoding) and a second pool."}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--gap-s", type=float, default=1.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    result: dict = {"bench": "disagg", "cpus": len(os.sched_getaffinity(0)), "workload": {
        "decoding_streams": a.streams, "stream_tokens": a.stream_tokens, "long_prompts": a.long,
        "long_prompt_tokens": a.long_tokens, "long_gap_s": a.gap_s, "rounds": a.rounds}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in DEPLOYMENTS.items():
            spec = edgeinfer_spec(a.threads, home=Path(tmp) / name)
            spec.cmd.extend(flags)
            runs = []
            with Running(spec, Path(tmp), 900.0) as srv:
                for r in range(a.rounds):
                    got = asyncio.run(workload(spec.url, spec.api_key or "", srv.model, a, random.Random(r)))
                    runs.append(got)
                    print(f"  {name:14s} round {r}: ITL p50 {got['itl_ms_p50']:.1f} ms p99 {got['itl_ms_p99']:.1f} ms, "
                          f"long TTFT p50 {got['long_ttft_s_p50']:.2f} s, {got['tokens_per_s']:.0f} tok/s",
                          flush=True)
                metrics = _metrics(spec.url)
            result["runs"][name] = {"command": "edgeinfer serve " + " ".join(flags), "rounds": runs,
                                    "gateway_disaggregated": metrics}
    med = {n: {k: statistics.median(r[k] for r in v["rounds"]) for k in
               ("itl_ms_p50", "itl_ms_p99", "long_ttft_s_p50", "long_ttft_s_max", "output_tok_s", "tokens_per_s")}
           for n, v in result["runs"].items()}
    result["median"] = med
    result["disaggregated_over_colocated"] = {k: med["disaggregated"][k] / med["colocated"][k]
                                              for k in med["colocated"]}
    result["projection"] = projection()
    for k, v in result["disaggregated_over_colocated"].items():
        print(f"  disaggregated / colocated {k}: {v:.2f}")
    result.update(run_stamp(t0, load0))
    write_result(result, a.out)
    return 0


def _metrics(url: str) -> dict:
    import re
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^edgeinfer_gateway_disaggregated_requests_total\{[^}]*outcome="(\w+)"\} (\S+)$', text, re.M)}


if __name__ == "__main__":
    raise SystemExit(main())
