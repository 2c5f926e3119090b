"""edgeinfer's in-process engine, built exactly as `edgeinfer serve`'s backend builds it (backend.server's
defaults), measured the way llama-bench and llama-batched-bench measure llama.cpp; and the perplexity of that
served model next to the GGUF's own weights dequantized to fp32 (the default model import).

  python -m benchmarks.harness.served_engine [--pp 512] [--tg 128] [--npp 128] [--ntg 64] [--npl 1,8,32] [--ppl]

Prints one JSON object (bench_peers runs it in a subprocess so its torch and memory stay out of the driver).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def served_engine():
    from edgeinfer.backend.server import build_state, parse_args

    args = parse_args(["--store-tier", "none", "--log-level", "WARNING", "--insecure-no-internal-auth"])  # in-process: no HTTP
    return build_state(args).engine, args


def engine_numbers(eng, a) -> dict:
    import torch

    from benchmarks.engine.vs_transformers import run_engine

    g = torch.Generator().manual_seed(0)

    def prompts(c: int, n: int) -> list[list[int]]:
        return [torch.randint(100, 49000, (n,), generator=g).tolist() for _ in range(c)]

    run_engine(eng, prompts(2, 16), 4, "warm")
    pp = []
    for i in range(a.reps):
        first, _ = run_engine(eng, prompts(1, a.pp), 1, f"pp{i}")
        pp.append(a.pp / first)
    tg = []
    for i in range(a.reps):
        first, total = run_engine(eng, prompts(1, 1), a.tg, f"tg{i}")
        tg.append((a.tg - 1) / (total - first))
    batched = []
    for c in a.npl:
        first, total = run_engine(eng, prompts(c, a.npp), a.ntg, f"b{c}")
        batched.append({"pp": a.npp, "tg": a.ntg, "batch": c, "prefill_tok_s": c * a.npp / first,
                        "decode_tok_s": c * (a.ntg - 1) / (total - first), "t_s": total})
        print(f"  engine batch {c}: decode {batched[-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return {f"pp{a.pp}_tok_s": statistics.median(pp), f"tg{a.tg}_tok_s": statistics.median(tg),
            "pp_runs": pp, "tg_runs": tg, "batched": batched, "threads": torch.get_num_threads()}


def perplexity(served_model, kv_dtype: str, chunks: int, chunk_len: int) -> dict:
    import torch

    from benchmarks.quality.perplexity import evaluate
    from edgeinfer.backend.model.gguf_import import default_gguf_path, ensure_default_model
    from edgeinfer.backend.model.loader import load_model
    from edgeinfer.backend.quant.calib import eval_text, token_chunks
    from edgeinfer.protocol.tokenizer import Tokenizer

    ref_dir = ensure_default_model()
    text, name = eval_text()
    ids = token_chunks(Tokenizer.from_dir(ref_dir).encode(text), chunks, chunk_len)
    served_ppl, served_pred, _ = evaluate(served_model, ids, kv_dtype)
    ref = load_model(ref_dir, dtype=torch.float32, device="cpu")
    ref_ppl, ref_pred, _ = evaluate(ref, ids, "fp32")
    return {"text": name, "chunks": chunks, "chunk_len": chunk_len, "gguf": default_gguf_path().name,
            "reference": f"{ref_dir.name} (GGUF dequantized to fp32, fp32 KV)", "reference_ppl": ref_ppl,
            "served_ppl": served_ppl, "served_kv_dtype": kv_dtype,
            "served_over_reference": served_ppl / ref_ppl,
            "greedy_agreement": float((served_pred == ref_pred).float().mean())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("--npl", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ppl", action="store_true", help="also the perplexity of the served model vs the GGUF's")
    ap.add_argument("--ppl-chunks", type=int, default=4)
    a = ap.parse_args()
    t = time.monotonic()
    eng, args = served_engine()
    m = eng.model
    out = {"model": eng.model_name, "fingerprint": eng.fingerprint, "kv_format": eng.kv_format,
           "dtype": args.dtype, "weight_bytes": m.weight_bytes(), "load_s": time.monotonic() - t,
           **engine_numbers(eng, a)}
    if a.ppl:
        out["perplexity"] = perplexity(m, args.kv_dtype, a.ppl_chunks, 512)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
