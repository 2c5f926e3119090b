"""Batch and chunk invariance of greedy decoding, fp32 KV vs fp8 KV, on the real SmolLM2 (CPU, torch references).

Every prompt is first generated alone, cold, prefilled in one chunk: the reference. Then the same prompt under
each condition, compared token by token with its reference:

  partial_hit  alone, after the prefix cache lost pages k.. (k = half the full pages, at least 1): pages < k
               are hits, the rest is recomputed as one chunk -- what the engine does when a page fetched from
               the store is corrupt (the store bridge writes the good pages byte for byte, then stops)
  repeat       alone, again (after partial_hit): every full prompt page is a prefix hit, the rest (1-16
               tokens) is prefilled
  batch16/8/2  in a group of 16/8/2 different prompts submitted together (continuous batching: their prefill
               chunks and decode steps share forwards)
  chunk16      alone, prefilled in 16-token chunks (max_num_batched_tokens=16)

For a divergent prompt: the first divergent position and the reference's top-1 minus top-2 logprob there
(a near-tie when small). For every prompt: the largest |logprob| difference of the chosen tokens before the
first divergence (how far the computation moved). For partial_hit: how many recomputed KV elements (fp32) or
bytes (fp8, scales included) differ from the cold run's.

  python -m benchmarks quality.batch_invariance [--prompts 100] [--tokens 32] [--kv fp32,fp8_e4m3]

Writes benchmarks/results/quality.batch_invariance.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.loading import in_fresh_thread
from edgeinfer.backend.model.gguf_import import ensure_default_model
from edgeinfer.backend.model.loader import load_model
from edgeinfer.protocol.page_id import page_hashes
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "quality.batch_invariance.json"
PAGE = 16


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randrange(40, 121))] for _ in range(n)]


def generate(eng: LLMEngine, prompts: list[list[int]], tokens: int, tag: str, namespaces: list[str]) -> list[dict]:
    """Submit all prompts together, step the engine until they finish; per prompt its tokens, the chosen
    tokens' logprobs and the top-1 minus top-2 logprob gaps."""
    recs: list[dict] = []
    for i, (p, ns) in enumerate(zip(prompts, namespaces, strict=True)):
        rec: dict = {"tokens": [], "lp": [], "gap": []}
        recs.append(rec)

        def emit(chunk, rec=rec) -> None:
            rec["tokens"] += chunk.token_ids
            for lp in chunk.logprobs or []:
                rec["lp"].append(lp.logprob)
                rec["gap"].append(lp.top[0][1] - lp.top[1][1])

        sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
        seq = eng._make_seq(GenerateRequest(f"{tag}-{i}", p, sp, ns), emit)
        eng._seqs[seq.request_id] = seq
        eng.scheduler.add(seq)
    while eng.scheduler.has_work:
        eng.step()
    return recs


def compare(ref: dict, got: dict) -> dict:
    n = min(len(ref["tokens"]), len(got["tokens"]))
    first = next((i for i in range(n) if ref["tokens"][i] != got["tokens"][i]), None)
    upto = n if first is None else first + 1    # the divergent position's logprobs are still comparable
    drift = max(abs(a - b) for a, b in zip(ref["lp"][:upto], got["lp"][:upto], strict=True))
    out = {"diverged": first is not None, "lp_drift": drift}
    if first is not None:
        out.update(first=first, ref_gap=ref["gap"][first], got_gap=got["gap"][first])
    return out


def page_bytes(eng: LLMEngine, hashes: list[bytes]) -> list[list[torch.Tensor]]:
    # read_page returns views of the pool on CPU: copy
    return [[t.clone() for t in eng.runner.read_page(eng.blocks.cache[h].page)] for h in hashes]


def kv_diff(cold: list[list[torch.Tensor]], warm: list[list[torch.Tensor]]) -> dict:
    total = differ = 0
    worst = 0.0
    for a_parts, b_parts in zip(cold, warm, strict=True):
        for a, b in zip(a_parts, b_parts, strict=True):
            if a.dtype == torch.float8_e4m3fn:
                a8, b8 = a.view(torch.uint8), b.view(torch.uint8)
                differ += int((a8 != b8).sum())
                total += a8.numel()
                worst = max(worst, float((a.float() - b.float()).abs().max()))
            else:
                differ += int((a != b).sum())
                total += a.numel()
                worst = max(worst, float((a.float() - b.float()).abs().max()))
    return {"elements": total, "differ": differ, "max_abs": worst}


def summarize(rows: list[dict]) -> dict:
    div = [r for r in rows if r["diverged"]]
    return {
        "prompts": len(rows),
        "diverged": len(div),
        "first_positions": [r["first"] for r in div],
        "ref_gaps_at_divergence": [round(r["ref_gap"], 6) for r in div],
        "max_lp_drift_before_divergence": max((r["lp_drift"] for r in rows), default=0.0),
        "median_lp_drift": sorted(r["lp_drift"] for r in rows)[len(rows) // 2] if rows else 0.0,
    }


def run_kv(model, kv: str, prompts: list[list[int]], tokens: int, conditions: list[str], save) -> dict:
    t0 = time.perf_counter()
    res: dict = {"kv_dtype": kv}
    eng = LLMEngine(model, None, EngineConfig(kv_dtype=kv, num_pages=256, max_num_batched_tokens=512))
    ref, rows_repeat, rows_partial, kvd = [], [], [], []
    for i, p in enumerate(prompts):
        ns = f"{kv}-p{i}"
        cold = generate(eng, [p], tokens, f"cold{i}", [ns])[0]
        ref.append(cold)
        hashes = page_hashes(eng.key_context(ns), p)[: len(p) // PAGE]
        k = max(1, len(hashes) // 2)
        if "partial_hit" in conditions:
            cold_pages = page_bytes(eng, hashes[k:])
            for h in hashes[k:]:
                eng.blocks.drop_cached(h)
            rows_partial.append(compare(cold, generate(eng, [p], tokens, f"part{i}", [ns])[0]))
            kvd.append(kv_diff(cold_pages, page_bytes(eng, hashes[k:])))
        if "repeat" in conditions:        # every full prompt page cached now (pages >= k: the recomputed ones)
            rows_repeat.append(compare(cold, generate(eng, [p], tokens, f"rep{i}", [ns])[0]))
    res["alone_gap_quantiles"] = _quantiles([g for r in ref for g in r["gap"]])
    if rows_repeat:
        res["repeat"] = summarize(rows_repeat)
    if rows_partial:
        res["partial_hit"] = summarize(rows_partial)
        res["partial_hit"]["kv"] = {
            "elements": sum(d["elements"] for d in kvd), "differ": sum(d["differ"] for d in kvd),
            "prompts_with_kv_diff": sum(d["differ"] > 0 for d in kvd), "max_abs": max(d["max_abs"] for d in kvd)}
    save(res)
    batched = LLMEngine(model, None, EngineConfig(kv_dtype=kv, num_pages=512, max_num_seqs=16,
                                                  max_num_batched_tokens=512, enable_prefix_cache=False))
    for size in (16, 8, 2):
        if f"batch{size}" not in conditions:
            continue
        rows = []
        for g in range(0, len(prompts), size):
            group = prompts[g:g + size]
            got = generate(batched, group, tokens, f"b{size}-{g}", ["b"] * len(group))
            rows += [compare(ref[g + j], got[j]) for j in range(len(group))]
        res[f"batch{size}"] = summarize(rows)
        save(res)
    if "chunk16" in conditions:
        chunked = LLMEngine(model, None, EngineConfig(kv_dtype=kv, num_pages=256, max_num_batched_tokens=PAGE,
                                                      enable_prefix_cache=False))
        res["chunk16"] = summarize([compare(ref[i], generate(chunked, [p], tokens, f"ch{i}", ["c"])[0])
                                    for i, p in enumerate(prompts)])
    res["seconds"] = round(time.perf_counter() - t0, 1)
    save(res)
    return res


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"positions": len(xs), "below_1e-3": sum(x < 1e-3 for x in xs), "below_1e-2": sum(x < 1e-2 for x in xs),
            "below_1e-1": sum(x < 1e-1 for x in xs), "median": xs[len(xs) // 2] if xs else None}


CONDITIONS = "partial_hit,repeat,batch16,batch8,batch2,chunk16"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kv", default="fp32,fp8_e4m3")
    ap.add_argument("--conditions", default=CONDITIONS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared, busy box)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    model = in_fresh_thread(load_model, ensure_default_model())
    prompts = make_prompts(args.prompts)
    results = {"model": "SmolLM2-135M-Instruct fp32", "prompts": args.prompts, "tokens": args.tokens,
               "prompt_lengths": "40-120 random token ids (seed 0)", "threads": torch.get_num_threads(),
               "machine": platform.machine(), "torch": torch.__version__, "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(run: dict) -> None:
        if not any(r is run for r in results["runs"]):
            results["runs"].append(run)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps(run), flush=True)

    for kv in args.kv.split(","):
        run_kv(model, kv, prompts, args.tokens, args.conditions.split(","), save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
