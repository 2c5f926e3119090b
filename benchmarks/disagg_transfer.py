"""How should a prefill node hand a prompt's KV to a decode node: directly, node to node, or through the page store?

  python -m benchmarks disagg_transfer [--prompt-tokens 2048] [--rounds 3]

Three backend processes of the default model (INT4, fp8 KV) and one valkey-server on loopback, the same seed,
page key and internal secret:
  prefill-direct  --role prefill, no page store tier: hands pages over on /internal/kv/pages
  prefill-store   --role both, the Redis tier: publishes every filled page to valkey (what `serve` runs)
  decode          --role decode, the Redis tier
Per round, each with its own random prompt (nothing cached anywhere), the decode node's time to its first token
(max_tokens 1) when
  direct      the prompt was prefilled on prefill-direct and the request names it (kv_source): a pull of sealed
              pages over HTTP, verified, written;
  store       the prompt was prefilled on prefill-store and every page of it published (waited for): the decode
              node's prefetch reads them from valkey, verified, written;
  recompute   nothing anywhere: the decode node prefills the whole prompt.
For the store path the wait between the prefill's end and its last page acknowledged by valkey is reported too:
a gateway using the store would have to wait that long before the second hop (or race the publisher).

The skip rule (gateway `disagg_min_prefill_tokens`): for prompts of --skip-lengths tokens, the first token's time
by two hops (prefill_only on prefill-direct, then the decode node with kv_source) against the decode node alone,
on idle nodes: below the length where two hops stop costing more, a prompt should not take the prefill hop.
Writes benchmarks/results/disagg_transfer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import run_stamp, write_result  # noqa: E402
from benchmarks.harness.servers import ProcessGroup, free_port, wait_http  # noqa: E402
from tests.support.backend_process import metric_sum  # noqa: E402
from tests.support.redis_server import ValkeyServer  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "disagg_transfer.json"
SECRET = "disagg-transfer-bench-internal-secret"
AUTH = {"authorization": f"Bearer {SECRET}"}
PAGE = 16


def generate(url: str, prompt: list[int], ns: str, **extra) -> tuple[float, dict]:
    body = {"request_id": f"b-{time.monotonic_ns()}", "prompt_token_ids": prompt, "cache_namespace": ns,
            "sampling": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}, **extra}
    t0 = time.perf_counter()
    last = None
    with requests.post(url + "/internal/generate", json=body, headers=AUTH, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line:
                last = line
    took = time.perf_counter() - t0
    chunk = json.loads(last or b"{}")
    if chunk.get("error"):
        raise RuntimeError(chunk["error"])
    return took, chunk.get("usage") or {}


def metric(url: str, name: str, **labels: str) -> float:
    return metric_sum(requests.get(url + "/metrics", headers=AUTH, timeout=10).text, name, **labels)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-lengths", default="32,64,128,256,512,1024")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model

    model_dir = ensure_native_default_model()
    full = (a.prompt_tokens - 1) // PAGE
    skip_lengths = [int(x) for x in a.skip_lengths.split(",") if x]
    skip: dict[int, dict[str, list[float]]] = {n: {"two_hops": [], "alone": []} for n in skip_lengths}
    rows: dict[str, list[float]] = {"direct": [], "store": [], "recompute": [], "store_publish_wait": [],
                                    "prefill_direct": [], "prefill_store": []}
    with tempfile.TemporaryDirectory() as tmp, ValkeyServer() as valkey:
        procs = ProcessGroup(Path(tmp))
        env = {**os.environ, "EDGEINFER_INTERNAL_SECRET": SECRET, "EDGEINFER_CACHE_SEED": "disagg-transfer-seed",
               "EDGEINFER_PAGE_KEY": "disagg-transfer-page-key-0123456789", "PYTHONPATH": str(ROOT)}
        env.pop("EDGEINFER_REDIS_URL", None)
        urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("prefill-direct", "prefill-store", "decode")}
        try:
            for name, flags in (("prefill-direct", ["--role", "prefill", "--store-tier", "none"]),
                                ("prefill-store", ["--redis-url", valkey.url, "--host-store-bytes", "0"]),
                                ("decode", ["--role", "decode", "--redis-url", valkey.url, "--host-store-bytes", "0",
                                            "--store-fetch-timeout", "30", "--handoff-timeout", "30",
                                            "--handoff-peers", urls["prefill-direct"]])):
                port = urls[name].rsplit(":", 1)[1]
                procs.start(name, [sys.executable, "-m", "edgeinfer.backend.server", "--model", str(model_dir),
                                   "--port", port, "--node-id", name, "--log-level", "WARNING", *flags], env)
            for url, (_, proc) in zip(urls.values(), procs.procs, strict=True):
                wait_http(url + "/ready", proc, 600.0)
            d, pd, ps = urls["decode"], urls["prefill-direct"], urls["prefill-store"]
            generate(d, [7] * 64, "warm")
            rng = random.Random(0)
            for r in range(a.rounds):
                def prompt() -> list[int]:
                    return [rng.randrange(1000, 40000) for _ in range(a.prompt_tokens)]
                for method in ("direct", "store", "recompute"):
                    ids, ns = prompt(), f"r{r}-{method}"
                    if method == "direct":
                        rows["prefill_direct"].append(generate(pd, ids, ns, prefill_only=True)[0])
                        took, usage = generate(d, ids, ns, kv_source={"node_id": "prefill-direct", "url": pd})
                    elif method == "store":
                        before = metric(ps, "edgeinfer_backend_page_store_pages_total", event="published")
                        rows["prefill_store"].append(generate(ps, ids, ns)[0])
                        w0 = time.perf_counter()
                        while metric(ps, "edgeinfer_backend_page_store_pages_total", event="published") < before + full:
                            if time.perf_counter() - w0 > 60:
                                raise RuntimeError("prefill-store did not publish the prompt's pages in 60 s")
                            time.sleep(0.005)
                        rows["store_publish_wait"].append(time.perf_counter() - w0)
                        took, usage = generate(d, ids, ns)
                    else:
                        took, usage = generate(d, ids, ns)
                    want = 0 if method == "recompute" else full * PAGE
                    if usage.get("cached_tokens") != want:
                        raise RuntimeError(f"{method}: the decode node reused {usage.get('cached_tokens')} prompt "
                                           f"tokens, expected {want}")
                    rows[method].append(took)
                for n in skip_lengths:
                    ids = [rng.randrange(1000, 40000) for _ in range(n)]
                    hop1 = generate(pd, ids, f"r{r}-skip{n}", prefill_only=True)[0]
                    hop2 = generate(d, ids, f"r{r}-skip{n}", kv_source={"node_id": "prefill-direct", "url": pd})[0]
                    alone = generate(d, [rng.randrange(1000, 40000) for _ in range(n)], f"r{r}-alone{n}")[0]
                    skip[n]["two_hops"].append(hop1 + hop2)
                    skip[n]["alone"].append(alone)
                print(f"  round {r}: decode TTFT direct {rows['direct'][-1] * 1e3:.0f} ms, store "
                      f"{rows['store'][-1] * 1e3:.0f} ms (+ publish wait {rows['store_publish_wait'][-1] * 1e3:.0f} ms)"
                      f", recompute {rows['recompute'][-1] * 1e3:.0f} ms", flush=True)
        finally:
            procs.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {"bench": "disagg_transfer", "prompt_tokens": a.prompt_tokens, "pages": full, "rounds": a.rounds,
              "runs_s": rows,
              "median_ms": {k: v * 1e3 for k, v in med.items()},
              "decode_ttft_direct_over_recompute": med["direct"] / med["recompute"],
              "decode_ttft_store_over_recompute": med["store"] / med["recompute"],
              "handoff_direct_ms": med["direct"] * 1e3,
              "handoff_store_ms_incl_publish_wait": (med["store"] + med["store_publish_wait"]) * 1e3,
              "store_over_direct_incl_publish_wait": (med["store"] + med["store_publish_wait"]) / med["direct"]}
    result["skip_rule"] = {str(n): {"two_hops_ms": 1e3 * statistics.median(v["two_hops"]),
                                    "alone_ms": 1e3 * statistics.median(v["alone"]),
                                    "two_hops_over_alone": statistics.median(v["two_hops"]) / statistics.median(v["alone"])}
                           for n, v in skip.items()}
    for n, row in result["skip_rule"].items():
        print(f"  {n:>5s} tokens: first token by two hops {row['two_hops_ms']:.0f} ms, decode node alone "
              f"{row['alone_ms']:.0f} ms ({row['two_hops_over_alone']:.2f}x)")
    result.update(run_stamp(t0, load0))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
