"""The GGUF's own INT4 weights served natively vs the dequantized fp32 import, side by side in one run.

Per variant, in its own process (so peak RSS is its own): weight bytes, peak RSS after loading and after
decoding, and engine decode steps at B sequences (64-token prompts; ms/step -> tok/s). Then perplexity
(benchmarks/quality/perplexity.py's harness: teacher-forced, held-out text) of the served native model vs the
GGUF's own dequantized weights through dense fp32 linears.

  python -m benchmarks engine.native_int4 [--batch 1,8,32] [--steps 10] [--repeats 2] [--chunks 4] [--no-ppl]
  python -m benchmarks engine.native_int4 --weight-error    # only: served bf16 scale/offset vs exact weights

Variants:
  fp32 dequantized     the dequantized import (today's tests' checkpoint), oneDNN-prepacked fp32 linears
  native int4          the served default: Q4_1 blocks on the CPU kernels (kernels/cpu; torch's CPU int4 GEMM
                       where they cannot be built), the Q8_0 embedding as int8 + scales, the tied head on the
                       embedding's own int8 table
  native, bf16 head    the same with the head held as plain bf16 (a comparison: more bytes, a slower GEMM here)
  torch only           python + torch + the package imported, no model (the floor every variant pays)
Writes benchmarks/results/engine.native_int4.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "engine.native_int4.json"
VARIANTS = ("torch only", "fp32 dequantized", "native int4", "native, bf16 head")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


class Bf16Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.bfloat16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.bfloat16(), self.weight).float()


def load(variant: str):
    from edgeinfer.backend.model.gguf_import import ensure_default_model, ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model

    if variant == "fp32 dequantized":
        return load_model(ensure_default_model())
    model = load_model(ensure_native_default_model())
    if variant == "native, bf16 head":
        model.lm_head_linear = Bf16Head(model.embed_tokens.dequantize())
    return model


def step_ms(model, batch: int, steps: int) -> float:
    from benchmarks.engine.step import decoding_engine

    eng = decoding_engine(model, batch, 64, num_pages=512, max_tokens=steps + 8, warmup=2)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t) / steps * 1000


def child(variant: str, batches: list[int], steps: int) -> dict:
    import edgeinfer.backend.engine.engine  # noqa: F401  (the import cost every variant pays)

    if variant == "torch only":
        return {"peak_rss_load_mb": round(peak_rss_mb(), 1)}
    model = load(variant)
    row = {"weight_bytes": model.weight_bytes() + model.prepacked_copy_bytes(),
           "peak_rss_load_mb": round(peak_rss_mb(), 1)}
    row["step_ms"] = {b: round(step_ms(model, b, steps), 2) for b in batches}
    row["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return row


def perplexity(chunks_n: int, chunk_len: int) -> list[dict]:
    from benchmarks.quality.perplexity import evaluate
    from edgeinfer.backend.model.gguf_import import ensure_default_model, ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model
    from edgeinfer.backend.quant.calib import eval_text, token_chunks
    from edgeinfer.protocol.tokenizer import Tokenizer

    text, name = eval_text()
    chunks = token_chunks(Tokenizer.from_dir(ensure_default_model()).encode(text), chunks_n, chunk_len)
    rows, ref = [], None
    for variant, path, prepack in [("gguf dequantized (fp32 dense)", ensure_default_model(), True),
                                   ("native int4 reference (exact weights)", ensure_native_default_model(), False),
                                   ("native int4 as served (prepacked: the CPU kernels, or torch int4 without them)", ensure_native_default_model(), True)]:
        model = load_model(path, prepack=prepack)
        ppl, pred, secs = evaluate(model, chunks, "fp32")
        ref = pred if ref is None else ref
        rows.append({"variant": variant, "ppl": round(ppl, 4), "agree": round(float((pred == ref).float().mean()), 4),
                     "positions": int(pred.numel()), "eval_text": name})
        print(f"  ppl {variant}: {ppl:.4f} ({secs:.0f}s)", flush=True)
        del model
    for r in rows:
        r["ppl_vs_dequantized"] = round(r["ppl"] / rows[0]["ppl"] - 1, 5)
    return rows


def bf16_weight_error() -> dict:
    """The served int4 GEMM's format vs the exact weights, over every Q4_1 linear: w' = (q - 8) * bf16(d)
    + bf16(m + 8 d) vs w = q * d + m."""
    from safetensors.torch import load_file

    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.packing import group_dequantize_mins, unpack_uint4

    t = load_file(str(ensure_native_default_model() / "model.safetensors"))
    num = den = worst = 0.0
    for key in [k for k in t if k.endswith(".qweight") and ".layers." in k]:
        p = key.removesuffix(".qweight")
        q, s, m = t[key], t[p + ".scales"].float(), t[p + ".mins"].float()
        w = group_dequantize_mins(q, s.half(), m.half(), 32)
        sb, zb = s.bfloat16().float(), (m + 8 * s).bfloat16().float()
        qq = unpack_uint4(q).float().reshape(w.shape[0], -1, 32)
        err = ((qq - 8) * sb[..., None] + zb[..., None]).reshape(w.shape) - w
        num, den = num + float((err ** 2).sum()), den + float((w ** 2).sum())
        worst = max(worst, float((err.abs() / s.repeat_interleave(32, 1).clamp(min=1e-12)).max()))
    return {"rel_rms": (num / den) ** 0.5, "worst_in_steps_d": worst}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved; the fastest is kept")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--weight-error", action="store_true", help="only the bf16 scale/offset weight error")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    batches = [int(x) for x in args.batch.split(",")]
    if args.weight_error:
        print(json.dumps(bf16_weight_error()))
        return 0
    if args.child:
        print(json.dumps(child(args.child, batches, args.steps)))
        return 0
    from edgeinfer.backend.model.gguf_import import ensure_default_model, ensure_native_default_model

    ensure_default_model(), ensure_native_default_model()   # imports happen here, not inside a timed child
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            out = subprocess.run([sys.executable, "-m", "benchmarks.engine.native_int4", "--child", v, "--batch", args.batch, "--steps",
                                  str(args.steps)], capture_output=True, text=True, check=True)
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {v}: {runs[v][-1]}", flush=True)
    rows = {}
    for v, rs in runs.items():
        row = {"peak_rss_load_mb": min(r["peak_rss_load_mb"] for r in rs)}
        if "step_ms" in rs[0]:
            row["weight_bytes"] = rs[0]["weight_bytes"]
            row["peak_rss_mb"] = min(r["peak_rss_mb"] for r in rs)
            row["step_ms"] = {b: min(r["step_ms"][str(b)] for r in rs) for b in batches}
            row["tok_s"] = {b: round(b * 1000 / row["step_ms"][b], 1) for b in batches}
        rows[v] = row
    base = rows["fp32 dequantized"]
    print(f"\n{'variant':<20} {'weight MB':>10} {'peak RSS MB':>12} " + " ".join(f"{'tok/s@' + str(b):>10}" for b in batches))
    for v, r in rows.items():
        if "tok_s" not in r:
            print(f"{v:<20} {'':>10} {r['peak_rss_load_mb']:>12.0f}")
            continue
        print(f"{v:<20} {r['weight_bytes'] / 1e6:>10.1f} {r['peak_rss_mb']:>12.0f} "
              + " ".join(f"{r['tok_s'][b]:>10.1f}" for b in batches))
        r["speedup_vs_fp32"] = {b: round(base["step_ms"][b] / r["step_ms"][b], 2) for b in batches}
    ppl = [] if args.no_ppl else perplexity(args.chunks, args.chunk_len)
    werr = bf16_weight_error()
    print(f"bf16 scale/offset weight error: {werr}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "rows": rows, "perplexity": ppl,
                               "bf16_weight_error": werr,
                               "host": {"platform": platform.platform(), "torch": torch.__version__,
                                        "threads": torch.get_num_threads()}}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
