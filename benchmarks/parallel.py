"""Tensor and expert parallelism on the CPU (gloo): bytes moved per step and the step time, TP=1 against TP=2 and
EP=2, on one model, measured side by side in one run.

  python -m benchmarks parallel [--quick] [--threads 2] [--out FILE]

The model: a random GLM-4.5-shaped MoE (transformers' Glm4MoeConfig: hidden 768, 4 layers, 16 experts top-4, one
shared expert, first layer dense; fp32). For each configuration (TP=1: one process with --threads threads; TP=2
and EP=2: two processes on torch.multiprocessing with --threads / 2 threads each, gloo over loopback) it times
decode steps at 1 / 8 sequences (--context tokens of context) and one prefill of --prefill tokens, and reads from
backend.parallel.comm the bytes each collective moved (all-reduce: the row-parallel outputs and the
vocab-parallel embedding; all-gather: the head's logits) and the wall time inside them. Per token: all-reduce
bytes / tokens of the step. Writes --out (default benchmarks/results/parallel.json).

On 2 cores, TP=2 cannot be faster than TP=1 (the same arithmetic on the same cores, plus the collectives): what
this measures is the collectives' volume and cost, the inputs of docs/MODELS.md's projection for 8 x H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.harness.results import run_stamp, write_result  # noqa: E402
from edgeinfer.backend.parallel.node import free_port as node_port  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=12, num_key_value_heads=4, head_dim=64, n_routed_experts=16, num_experts_per_tok=4,
             n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True,
             attention_bias=True, partial_rotary_factor=0.5, num_nextn_predict_layers=0, tie_word_embeddings=False,
             max_position_embeddings=4096)


def build(out: Path) -> None:
    from tests.support.hf_compat import hide_hub_kernels

    hide_hub_kernels()
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Glm4MoeConfig(**SHAPE)).eval().save_pretrained(out)


def measure(model, levels: list[int], context: int, prefill: int, steps: int, comm=None) -> dict:
    """Decode ms per step per level and one prefill, with the collectives' bytes and seconds of each phase."""
    from tests.support.dense import decode_batch, prefill_batch

    out: dict = {"decode": {}, "prefill": {}}
    g = torch.Generator().manual_seed(0)

    def snap():
        return dict(comm.stats.snapshot()) if comm is not None else {}

    def delta(a: dict, b: dict, n: int) -> dict:
        return {k: round((b[k] - a[k]) / n, 6) for k in a} if a else {}

    with torch.inference_mode():
        for b in levels:
            kv, pos, meta = decode_batch(model, b, context)
            ids = torch.randint(100, 30000, (b,), generator=g)
            for _ in range(2):
                model.compute_logits(model(ids, pos, kv, meta))
            s0, t0 = snap(), time.perf_counter()
            for _ in range(steps):
                model.compute_logits(model(ids, pos, kv, meta))
            ms = (time.perf_counter() - t0) / steps * 1000
            per_step = delta(s0, snap(), steps)
            out["decode"][str(b)] = {"step_ms": round(ms, 2), "collectives_per_step": per_step,
                                     "all_reduce_bytes_per_token": (per_step.get("all_reduce_bytes", 0) / b
                                                                    if per_step else 0)}
        kv, meta = prefill_batch(model, prefill)
        ids = torch.randint(100, 30000, (prefill,), generator=g)
        model.compute_logits(model(ids, torch.arange(prefill), kv, meta)[-1:])
        s0, t0 = snap(), time.perf_counter()
        model.compute_logits(model(ids, torch.arange(prefill), kv, meta)[-1:])
        per = delta(s0, snap(), 1)
        out["prefill"] = {"ms": round((time.perf_counter() - t0) * 1000, 1), "collectives": per,
                          "all_reduce_bytes_per_token": per.get("all_reduce_bytes", 0) / prefill if per else 0}
    return out


def _rank(rank: int, world: int, port: int, model_dir: str, expert_parallel: bool, threads: int, levels, context,
          prefill, steps, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(threads)
    from edgeinfer.backend.parallel.node import run_rank

    def run(node) -> None:
        res = measure(node, levels, context, prefill, steps, node.comm)
        res["weight_bytes_rank0"] = node.shard.weight_bytes()
        Path(out).write_text(json.dumps(res))
    run_rank(rank, world, port, model_dir, expert_parallel, run, timeout_s=300)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="levels 1, context 32, prefill 32, 2 steps (the smoke run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--prefill", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "parallel.json")
    a = ap.parse_args(argv)
    levels = [1] if a.quick else [1, 8]
    context = a.context or (32 if a.quick else 256)
    prefill = a.prefill or (32 if a.quick else 256)
    steps = 2 if a.quick else 8
    t0, load0 = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "glm"
        build(model_dir)
        from edgeinfer.backend.model.loader import load_model

        torch.set_num_threads(a.threads)
        one = load_model(model_dir)
        results = {"tp1": measure(one, levels, context, prefill, steps)}
        results["tp1"]["weight_bytes_rank0"] = one.weight_bytes()
        del one
        for name, ep in (("tp2", False), ("ep2", True)):
            out = Path(tmp) / f"{name}.json"
            mp.start_processes(_rank, args=(2, node_port(), str(model_dir), ep, max(1, a.threads // 2), levels,
                                            context, prefill, steps, str(out)),
                               nprocs=2, join=True, start_method="spawn")
            results[name] = json.loads(out.read_text())
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    ratios = {f"{n} / tp1 decode step time @{b}": round(results[n]["decode"][b]["step_ms"] / results["tp1"]["decode"][b]
                                                        ["step_ms"], 2) for n in ("tp2", "ep2") for b in map(str, levels)}
    ratios |= {f"{n} rank-0 weight bytes / tp1": round(results[n]["weight_bytes_rank0"]
                                                      / results["tp1"]["weight_bytes_rank0"], 3) for n in ("tp2", "ep2")}
    result = {"bench": "bench_parallel", "shape": SHAPE, "threads": a.threads, "levels": levels, "context": context,
              "prefill": prefill, "results": results, "ratios": ratios, **run_stamp(t0, load0)}
    write_result(result, a.out, echo=False)
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
