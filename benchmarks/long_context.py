"""KV formats at long context, the served default model, side by side in one run; llama.cpp's q8_0 vs f16
KV on the same GGUF beside it.

  python -m benchmarks long_context [--contexts 1024,4096,8000] [--seqs 1,8,32] [--max-tokens 65536]
      [--kv fp32,auto] [--decode 32] [--rounds 2] [--llamacpp-build /work/peers/llama-build] [--out FILE]

Ours (in-process engines built as backend.server builds them, with each --kv (auto: what `edgeinfer serve`
serves, the format the KV gate picks; fp32 the exact counterpart), a KV budget
large enough for the largest case): for each context length c and sequence count s with c * s <= --max-tokens,
s prompts of c distinct random tokens are prefilled, then --decode greedy tokens each; decode tok/s is
s * (decode - 1) over the time after the last first token. The two KV dtypes alternate, --rounds times
(medians). Also:
  max seqs     sequences of each context length whose pages fit the DEFAULT budget (--kv-cache-bytes 512 MiB)
  ppl 4k / 8k  perplexity over one 4096- / 8192-token window of CPython's idlelib/NEWS.txt, every position
               scored, through the paged pool in that KV dtype (8k when a context of 8000 or more is run)
  TTFT         seconds until every sequence of a case has its first token (median over rounds)
llama.cpp (where llama-bench / llama-perplexity are in --llamacpp-build): llama-bench tg at depth c (batch 1,
-fa on) with -ctk/-ctv q8_0 and f16, llama-bench pp at each context (batch-1 TTFT = tokens / pp rate),
llama-batched-bench's decode rate at each context x each --seqs above 1 (f16 KV, -fa on), and
llama-perplexity -c 4096 with each.
Writes benchmarks/results/long_context.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import interleaved, run_stamp, write_result  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "long_context.json"
DEFAULT_BUDGET = 512 << 20


def engine(kv: str, budget: int):
    from edgeinfer.backend.server import build_state, parse_args

    argv = ["--store-tier", "none", "--log-level", "WARNING", "--insecure-no-internal-auth", "--kv-dtype", kv,
            "--kv-cache-bytes", str(budget), "--no-prefix-cache"]
    return build_state(parse_args(argv)).engine


def decode_rate(eng, ctx: int, seqs: int, decode: int, seed: int) -> tuple[float, float]:
    """(decode tok/s after the last first token, seconds until every sequence had its first token)."""
    import torch

    from benchmarks.engine.vs_transformers import run_engine

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 49000, (ctx,), generator=g).tolist() for _ in range(seqs)]
    first, total = run_engine(eng, prompts, decode, f"lc{ctx}x{seqs}s{seed}")
    return seqs * (decode - 1) / (total - first), first


def ppl_at(eng, n: int = 4096) -> float:
    import math

    import torch

    from edgeinfer.backend.quant.calib import eval_text, paged_prefill

    text, _ = eval_text()
    ids = eng.tokenizer.encode(text)[:n]
    with torch.inference_mode():
        logits = eng.model.compute_logits(paged_prefill(eng.model, [ids], eng.cfg.kv_dtype, 16)[:-1])
        nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="mean")
    return math.exp(float(nll))


def max_seqs_default_budget(eng) -> dict:
    """Sequences of each context length whose pages fit backend.server's default --kv-cache-bytes."""
    per_token = eng.runner.bytes_per_token
    pages = DEFAULT_BUDGET // (per_token * 16)
    return {"kv_bytes_per_token": per_token, "pages": pages,
            **{str(c): pages // -(-c // 16) for c in (1024, 4096, 8000)}}


def llamacpp(build: Path, gguf: Path, contexts: list[int], seqs: list[int], decode: int, threads: int) -> dict:
    from benchmarks.harness.servers import find_binary

    bench, ppl = find_binary("llama-bench", build), find_binary("llama-perplexity", build)
    batched = find_binary("llama-batched-bench", build)
    out: dict = {}
    many = [s for s in seqs if s > 1]
    if batched is not None and many:
        out["batched_tg_tok_s_f16"] = {}
        for c in contexts:
            cmd = [str(batched), "-m", str(gguf), "-t", str(threads), "-c", str((c + decode) * max(many) + 256),
                   "-b", "2048", "-ub", "512", "-npp", str(c), "-ntg", str(decode), "-npl", ",".join(map(str, many)),
                   "-fa", "on", "-ctk", "f16", "-ctv", "f16", "--output-format", "jsonl"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            for line in r.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    out["batched_tg_tok_s_f16"][f"{c}x{row.get('pl')}"] = row.get("speed_tg")
            out["batched_command"] = " ".join(cmd)
    if bench is not None:
        for kv in ("f16", "q8_0"):
            cmd = [str(bench), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "32", "-r", "2", "-fa", "1",
                   "-ctk", kv, "-ctv", kv, "-d", ",".join(map(str, contexts)), "-o", "json"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            rows = json.loads(r.stdout[r.stdout.index("["):]) if "[" in r.stdout else []
            out[f"tg32_at_depth_{kv}"] = {str(x.get("n_depth")): x.get("avg_ts") for x in rows}
            out["bench_command"] = " ".join(cmd)
        cmd = [str(bench), "-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, contexts)), "-n", "0",
               "-r", "1", "-fa", "1", "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        rows = json.loads(r.stdout[r.stdout.index("["):]) if "[" in r.stdout else []
        out["pp_tok_s"] = {str(x.get("n_prompt")): x.get("avg_ts") for x in rows}
        out["ttft_s_batch1"] = {k: (int(k) / v if v else None) for k, v in out["pp_tok_s"].items()}
        out["pp_command"] = " ".join(cmd)
    if ppl is not None:
        from edgeinfer.backend.quant.calib import eval_text

        text_file = build / "news.txt"
        text_file.write_text(eval_text()[0])
        for kv in ("f16", "q8_0"):
            cmd = [str(ppl), "-m", str(gguf), "-f", str(text_file), "-c", "4096", "--chunks", "1", "-t", str(threads),
                   "-fa", "on", "-ctk", kv, "-ctv", kv]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
            out[f"ppl_4k_{kv}"] = float(m.group(1)) if m else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096,8000", help="8000: 8k less the decoded tokens (8192 max)")
    ap.add_argument("--seqs", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=65536, help="skip cases above contexts x seqs tokens")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--kv", default="fp32,auto", help="KV dtypes side by side (auto: the served default)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-build", type=Path, default=None)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    t0, load0 = time.monotonic(), os.getloadavg()
    contexts = [int(x) for x in a.contexts.split(",")]
    seqs = [int(x) for x in a.seqs.split(",")]
    cases = [(c, s) for c in contexts for s in seqs if c * s <= a.max_tokens]
    biggest = max(c * s for c, s in cases) + 16 * max(seqs) * 4
    KV = tuple(x for x in a.kv.split(",") if x)
    engines = {kv: engine(kv, biggest * 46080 + (64 << 20)) for kv in KV}
    rates: dict = {kv: {f"{c}x{s}": [] for c, s in cases} for kv in KV}
    ttfts: dict = {kv: {f"{c}x{s}": [] for c, s in cases} for kv in KV}
    for r, kv in interleaved(list(KV), a.rounds):
        for c, s in cases:
            rate, first = decode_rate(engines[kv], c, s, a.decode, seed=r)
            rates[kv][f"{c}x{s}"].append(rate)
            ttfts[kv][f"{c}x{s}"].append(first)
            print(f"round {r} {kv:>8} ctx {c:>5} x {s:>2}: {rate:.1f} tok/s, all first tokens in {first:.2f} s",
                  flush=True)
    result: dict = {"cases": [f"{c}x{s}" for c, s in cases], "decode_tokens": a.decode, "rounds": a.rounds,
                    "threads": a.threads, "ours": {}}
    ppl_lengths = [n for n in (4096, 8192) if n <= max(contexts) + 192]
    for kv in KV:
        result["ours"][kv] = {"decode_tok_s": {k: statistics.median(v) for k, v in rates[kv].items()},
                              "ttft_s": {k: statistics.median(v) for k, v in ttfts[kv].items()},
                              "runs": rates[kv], **{f"ppl_{n // 1024}k": ppl_at(engines[kv], n) for n in ppl_lengths},
                              "max_seqs_default_budget": max_seqs_default_budget(engines[kv]),
                              "kv_format": engines[kv].kv_format}
    served = result["ours"]["auto" if "auto" in KV else KV[-1]]
    if "fp32" in KV and served is not result["ours"]["fp32"]:
        f32 = result["ours"]["fp32"]
        result["served_over_fp32"] = {
            "served": served["kv_format"],
            "decode": {k: served["decode_tok_s"][k] / f32["decode_tok_s"][k] for k in result["cases"]},
            "ttft": {k: served["ttft_s"][k] / f32["ttft_s"][k] for k in result["cases"]},
            **{f"ppl_{n // 1024}k": served[f"ppl_{n // 1024}k"] / f32[f"ppl_{n // 1024}k"] for n in ppl_lengths},
            "max_seqs_4k_default_budget": served["max_seqs_default_budget"]["4096"]
            / f32["max_seqs_default_budget"]["4096"]}
    if a.llamacpp_build:
        from edgeinfer.backend.model.gguf_import import default_gguf_path

        lc = result["llamacpp"] = llamacpp(a.llamacpp_build, default_gguf_path(), contexts, seqs, a.decode, a.threads)
        f16, many = lc.get("tg32_at_depth_f16", {}), lc.get("batched_tg_tok_s_f16", {})
        result["served_over_llamacpp_f16"] = {
            "served": served["kv_format"],
            "decode": {**{f"{c}x1": served["decode_tok_s"][f"{c}x1"] / f16[str(c)]
                          for c in contexts if f"{c}x1" in served["decode_tok_s"] and f16.get(str(c))},
                       **{k: served["decode_tok_s"][k] / v for k, v in many.items()
                          if k in served["decode_tok_s"] and v}},
            "ttft_batch1": {str(c): served["ttft_s"][f"{c}x1"] / lc["ttft_s_batch1"][str(c)]
                            for c in contexts if f"{c}x1" in served["ttft_s"]
                            and lc.get("ttft_s_batch1", {}).get(str(c))}}
    result.update(run_stamp(t0, load0))
    write_result(result, a.out, echo=False)
    print(json.dumps({k: result.get(k) for k in ("served_over_fp32", "served_over_llamacpp_f16", "llamacpp")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
