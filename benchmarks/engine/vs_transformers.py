"""Engine vs transformers generate() on the same model, measured side by side in one run.

Decode tokens/s at 1, 8 and 32 concurrent sequences (decode time = total - time to first token, on both
sides), and TTFT of a 1k-token prompt cold vs with a prefix-cache hit. Writes benchmarks/results/engine.vs_transformers.json.

Both sides run their torch work with exactly one live OpenMP pool (see backend.engine.engine.in_fresh_thread):
models load on threads that exit, the engine thread is stopped while transformers runs, and transformers runs
on a fresh thread. `--ablate` adds a second engine with plain-layout GEMMs (EDGEINFER_CPU_PREPACK=0), to show
what the oneDNN-prepacked weights contribute.

  python -m benchmarks engine.vs_transformers [--new-tokens 32] [--prompt-len 64] [--ablate] [--dtype bfloat16 --out F]
  python -m benchmarks engine.vs_transformers --device cuda --graphs both [--no-hf] [--native-int4] [--kv-dtype fp8_e4m3]

`--dtype` sets the weight/activation dtype of both sides (default float32 on cpu, bfloat16 on cuda); the KV
cache follows it unless --kv-dtype says otherwise. `--graphs both` measures decode CUDA graphs on vs off.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.loading import in_fresh_thread
from edgeinfer.backend.model.gguf_import import ensure_default_model
from edgeinfer.backend.model.loader import load_model
from edgeinfer.protocol.tokenizer import Tokenizer
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "engine.vs_transformers.json"


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


def graphs_info(eng: LLMEngine) -> dict:
    g = eng.runner.graphs
    return {"cuda_graphs": g is not None, "captured_buckets": sorted(g.graphs) if g is not None else []}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--ablate", action="store_true", help="also run the engine with plain-layout GEMMs")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="weights/activations (default float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "fp8_e4m3"])
    ap.add_argument("--native-int4", action="store_true", help="the served default: the GGUF's own INT4 weights")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="another checkpoint (e.g. benchmarks/harness/checkpoints.py's); its tokenizer is optional")
    ap.add_argument("--graphs", default="on", choices=["on", "off", "both"],
                    help="decode CUDA graphs (cuda only; 'both' adds engine_graphs_off beside engine)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (ratios omitted)")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_engine: --device cuda but torch sees no CUDA device")
    if not args.no_hf:
        from tests.support.hf_compat import hide_hub_kernels

        hide_hub_kernels()

    def load():
        from edgeinfer.backend.model.gguf_import import ensure_native_default_model

        if args.model_dir is not None:
            model_dir = args.model_dir
        else:
            model_dir = ensure_native_default_model() if args.native_int4 else ensure_default_model()
        tok = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, kv_dtype=args.kv_dtype,
                           cuda_graphs=args.graphs != "off")
        model = load_model(model_dir, dtype=dtype, device=args.device)
        engines = {"engine": LLMEngine(model, tok, cfg)}
        if args.graphs == "both":
            engines["engine_graphs_off"] = LLMEngine(model, tok, dataclasses.replace(cfg, cuda_graphs=False))
        if args.ablate:
            engines["engine_plain_gemm"] = LLMEngine(load_model(model_dir, dtype=dtype, prepack=False), tok, cfg)
        hf = None
        if not args.no_hf:
            from transformers import LlamaForCausalLM

            hf = LlamaForCausalLM.from_pretrained(ensure_default_model(), torch_dtype=dtype).eval().to(args.device)
        return model_dir, engines, hf

    model_dir, engines, hf = in_fresh_thread(load)
    g = torch.Generator().manual_seed(0)
    rows = []
    new = args.new_tokens
    levels = [int(x) for x in args.concurrency.split(",")]
    for eng in engines.values():     # warm-up (on CUDA: Triton compiles, each level's decode graph is captured)
        for c in levels if args.device == "cuda" else levels[:1]:
            run_engine(eng, [torch.randint(100, 49000, (16,), generator=g).tolist() for _ in range(c)], 4, "warm")
    if hf is not None:
        in_fresh_thread(hf_batch, hf, [torch.randint(100, 49000, (16,), generator=g).tolist()], 4)
    for c in levels:
        prompts = [torch.randint(100, 49000, (args.prompt_len,), generator=g).tolist() for _ in range(c)]
        row: dict = {"concurrency": c}
        h_tps = None
        if hf is not None:
            h_first, h_total = in_fresh_thread(hf_batch, hf, prompts, new)
            h_tps = c * (new - 1) / max(h_total - h_first, 1e-9)
            row |= {"transformers_decode_tok_s": h_tps, "transformers_total_s": h_total}
        for name, eng in engines.items():
            e_first, e_total = run_engine(eng, prompts, new, f"c{c}")
            e_tps = c * (new - 1) / max(e_total - e_first, 1e-9)
            row |= {f"{name}_decode_tok_s": e_tps, f"{name}_total_s": e_total}
            if h_tps is not None:
                row["ratio" if name == "engine" else f"{name}_ratio"] = e_tps / h_tps
        if "engine_graphs_off" in engines:
            row["graphs_on_over_off"] = row["engine_decode_tok_s"] / row["engine_graphs_off_decode_tok_s"]
        rows.append(row)
        print(f"concurrency {c:3d}: " + "   ".join(
            f"{name} {row[f'{name}_decode_tok_s']:7.1f} tok/s" for name in engines) +
            (f"   transformers {h_tps:7.1f} tok/s   ratio {row['ratio']:5.2f}x" if h_tps is not None else "") +
            (f"   graphs on/off {row['graphs_on_over_off']:5.2f}x" if "graphs_on_over_off" in row else ""), flush=True)
    ttft = None
    if not args.skip_ttft:
        eng = engines["engine"]
        prompt = torch.randint(100, 49000, (1024,), generator=g).tolist()
        cold_first, _ = run_engine(eng, [prompt], 1, "ttft-cold")
        warm_first, _ = run_engine(eng, [prompt + [500, 501, 502]], 1, "ttft-cold")
        ttft = {"prompt_tokens": 1024, "engine_cold_s": cold_first, "engine_prefix_hit_s": warm_first,
                "hit_over_cold": warm_first / cold_first}
        msg = f"TTFT 1k prompt: cold {cold_first * 1000:.0f} ms, prefix hit {warm_first * 1000:.0f} ms " \
              f"({warm_first / cold_first:.3f}x)"
        if hf is not None:
            h_first, _ = in_fresh_thread(hf_batch, hf, [prompt], 2)
            ttft["transformers_s"] = h_first
            msg += f", transformers {h_first * 1000:.0f} ms"
        print(msg, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out.write_text(json.dumps({"model": str(args.model_dir) if args.model_dir else model_dir.name,
                               "native_int4": args.native_int4, "dtype": args.dtype,
                               "kv_dtype": engines["engine"].kv_format, "device": device,
                               "threads": torch.get_num_threads(), "machine": platform.machine(),
                               "cpu_prepack": args.device == "cpu", "new_tokens": new,
                               "prompt_len": args.prompt_len,
                               "engines": {name: graphs_info(e) for name, e in engines.items()},
                               "decode": rows, "ttft": ttft}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
