"""Engine vs transformers generate() on the same model, measured side by side in one run.

Decode tokens/s at 1, 8 and 32 concurrent sequences (decode time = total - time to first token, on both
sides), and TTFT of a 1k-token prompt cold vs with a prefix-cache hit. Writes benchmarks/results/bench_engine.json.

Both sides run their torch work with exactly one live OpenMP pool (see backend.engine.engine.in_fresh_thread):
models load on threads that exit, the engine thread is stopped while transformers runs, and transformers runs
on a fresh thread. `--ablate` adds a second engine with plain-layout GEMMs (EDGEINFER_CPU_PREPACK=0), to show
what the oneDNN-prepacked weights contribute.

  python benchmarks/bench_engine.py [--new-tokens 32] [--prompt-len 64] [--ablate] [--dtype bfloat16 --out F]

`--dtype` sets the weight/activation dtype of both sides (default float32); the KV cache follows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

import torch

from backend.engine.config import EngineConfig
from backend.engine.engine import LLMEngine, in_fresh_thread
from backend.model.gguf_import import ensure_default_model
from backend.model.llama import load_model
from protocol.tokenizer import Tokenizer
from protocol.wire import GenerateRequest, SamplingParams

OUT = Path(__file__).parent / "results" / "bench_engine.json"


async def engine_batch(eng: LLMEngine, prompts: list[list[int]], new: int, ns: str) -> tuple[float, float]:
    """Returns (seconds until every sequence has its first token, total seconds)."""
    t0 = time.perf_counter()
    firsts: list[float] = []

    async def one(i: int, p: list[int]) -> None:
        req = GenerateRequest(f"{ns}-{i}", p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), ns)
        first = True
        async for _ in eng.generate(req):
            if first:
                firsts.append(time.perf_counter() - t0)
                first = False

    await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return max(firsts), time.perf_counter() - t0


def hf_batch(hf, prompts: list[list[int]], new: int) -> tuple[float, float]:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
        t1 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=0)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def run_engine(eng: LLMEngine, prompts: list[list[int]], new: int, ns: str) -> tuple[float, float]:
    eng.start()                      # its thread (and OpenMP pool) live only while it is measured
    try:
        return asyncio.run(engine_batch(eng, prompts, new, ns))
    finally:
        eng.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--ablate", action="store_true", help="also run the engine with plain-layout GEMMs")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    from tests.hf_compat import hide_hub_kernels

    hide_hub_kernels()
    from transformers import LlamaForCausalLM

    def load():
        model_dir = ensure_default_model()
        tok = Tokenizer.from_dir(model_dir)
        cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048)
        engines = {"engine": LLMEngine(load_model(model_dir, dtype=dtype), tok, cfg)}
        if args.ablate:
            engines["engine_plain_gemm"] = LLMEngine(load_model(model_dir, dtype=dtype, prepack=False), tok, cfg)
        hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).eval()
        return model_dir, engines, hf

    model_dir, engines, hf = in_fresh_thread(load)
    g = torch.Generator().manual_seed(0)
    rows = []
    new = args.new_tokens
    for eng in engines.values():     # warm-up
        run_engine(eng, [torch.randint(100, 49000, (16,), generator=g).tolist()], 4, "warm")
    in_fresh_thread(hf_batch, hf, [torch.randint(100, 49000, (16,), generator=g).tolist()], 4)
    for c in [int(x) for x in args.concurrency.split(",")]:
        prompts = [torch.randint(100, 49000, (args.prompt_len,), generator=g).tolist() for _ in range(c)]
        h_first, h_total = in_fresh_thread(hf_batch, hf, prompts, new)
        h_tps = c * (new - 1) / max(h_total - h_first, 1e-9)
        row = {"concurrency": c, "transformers_decode_tok_s": h_tps, "transformers_total_s": h_total}
        for name, eng in engines.items():
            e_first, e_total = run_engine(eng, prompts, new, f"c{c}")
            e_tps = c * (new - 1) / max(e_total - e_first, 1e-9)
            row |= {f"{name}_decode_tok_s": e_tps, f"{name}_total_s": e_total,
                    ("ratio" if name == "engine" else f"{name}_ratio"): e_tps / h_tps}
        rows.append(row)
        print(f"concurrency {c:3d}: " + "   ".join(
            f"{name} {row[f'{name}_decode_tok_s']:7.1f} tok/s" for name in engines) +
            f"   transformers {h_tps:7.1f} tok/s   ratio {row['ratio']:5.2f}x", flush=True)
    eng = engines["engine"]
    prompt = torch.randint(100, 49000, (1024,), generator=g).tolist()
    cold_first, _ = run_engine(eng, [prompt], 1, "ttft-cold")
    warm_first, _ = run_engine(eng, [prompt + [500, 501, 502]], 1, "ttft-cold")
    h_first, _ = in_fresh_thread(hf_batch, hf, [prompt], 2)
    ttft = {"prompt_tokens": 1024, "engine_cold_s": cold_first, "engine_prefix_hit_s": warm_first,
            "hit_over_cold": warm_first / cold_first, "transformers_s": h_first}
    print(f"TTFT 1k prompt: cold {cold_first * 1000:.0f} ms, prefix hit {warm_first * 1000:.0f} ms "
          f"({warm_first / cold_first:.3f}x), transformers {h_first * 1000:.0f} ms", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model_dir.name, "dtype": args.dtype, "device": "cpu",
                               "threads": torch.get_num_threads(), "machine": platform.machine(),
                               "cpu_prepack": True, "new_tokens": new, "prompt_len": args.prompt_len,
                               "decode": rows, "ttft": ttft}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
