"""INT4 weights and FP8 KV: accuracy and memory, measured side by side in one run.

    python -m benchmarks quality.perplexity [--model DIR] [--chunks 4] [--chunk-len 512] [--budget-gib 16]

For each variant: teacher-forced forwards through the real paged model (kernels' torch references on
CPU) over `chunks` x `chunk-len` tokens of a held-out text, then
  ppl          perplexity of the next token
  agree        greedy next-token agreement with the fp32 model (argmax equal), over every position
  weight bytes total, and of the linear layers (qkv/o/gate_up/down)
  kv B/token   2 * layers * kv_heads * (head_dim * bytes + scale bytes)
  max seqs     2k-token sequences whose pages fit a fixed KV budget (page_size 16)
Held-out text: CPython's Lib/idlelib/NEWS.txt. Calibration (AWQ, GPTQ): other files (backend.quant.calib).
Quantized checkpoints are made once next to the model (quantize time is reported, not compared).
Writes benchmarks/results/quality.perplexity.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from edgeinfer.backend.engine.kv_pool import kv_bytes_per_token
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.quant.calib import eval_text, paged_prefill, token_chunks
from edgeinfer.backend.quant.quantize import quantize_checkpoint
from edgeinfer.protocol.tokenizer import Tokenizer

PAGE = 16
SEQ_LEN = 2048
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "quality.perplexity.json"


QUANT_VERSION = "v2"   # bump when the quantizer's output changes, so cached checkpoints are not reused


def quantized_dir(model_dir: Path, method: str, scheme: str, calibration: str) -> tuple[Path, float | None]:
    """Cached next to the model; the name carries everything that changes the weights."""
    calib = "" if method == "rtn" else f"-{calibration}"
    dst = model_dir.parent / f"{model_dir.name}-{scheme}-{method}{calib}-{QUANT_VERSION}"
    if (dst / "config.json").is_file():
        return dst, None
    t = time.time()
    quantize_checkpoint(model_dir, dst, scheme, method, calibration=calibration)
    return dst, time.time() - t


@torch.inference_mode()
def evaluate(model, chunks, kv_dtype: str) -> tuple[float, torch.Tensor, float]:
    t = time.time()
    nll, n, preds = 0.0, 0, []
    for c in chunks:
        logits = model.compute_logits(paged_prefill(model, [c], kv_dtype, PAGE)[:-1])
        target = torch.tensor(c[1:])
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        n += len(target)
        preds.append(logits.argmax(-1))
    return math.exp(nll / n), torch.cat(preds), time.time() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="fp32 HF checkpoint dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--budget-gib", type=float, default=16.0, help="fixed KV budget for max concurrent seqs")
    ap.add_argument("--methods", default="rtn,awq,awq-gptq", help="also: gptq (slow on CPU)")
    ap.add_argument("--scheme", default="w4a16-g64", help="w4a16-g64 (0.28x bf16 linear bytes) | w4a16-g128")
    ap.add_argument("--calibration", default="mix", help="mix | tqdm (see backend.quant.calib)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.model is None:
        from edgeinfer.backend.model.gguf_import import ensure_default_model
        args.model = ensure_default_model()
    model_dir = Path(args.model)
    text, text_name = eval_text()
    chunks = token_chunks(Tokenizer.from_dir(model_dir).encode(text), args.chunks, args.chunk_len)
    budget = int(args.budget_gib * (1 << 30))

    quant_dirs, quant_secs = {}, {}
    for m in args.methods.split(","):
        quant_dirs[m], quant_secs[m] = quantized_dir(model_dir, m, args.scheme, args.calibration)

    bf16, fp32, fp8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
    variants = [("fp32", model_dir, fp32, "fp32", None), ("bf16", model_dir, bf16, "bf16", None)]
    variants += [(f"int4-{m}", quant_dirs[m], bf16, "bf16", None) for m in quant_dirs]
    variants += [("fp8 KV", model_dir, bf16, "fp8_e4m3", None)]
    best = next((m for m in ("awq-gptq", "awq") if m in quant_dirs), next(iter(quant_dirs)))
    variants += [(f"int4-{best} + fp8 KV", quant_dirs[best], bf16, "fp8_e4m3", None)]

    rows, ref_pred = [], None
    for name, path, dtype, kv, _ in variants:
        model = load_model(path, dtype, "cpu")
        ppl, pred, secs = evaluate(model, chunks, kv)
        if ref_pred is None:
            ref_pred = pred
        bpt = kv_bytes_per_token(model, {"fp32": fp32, "bf16": bf16, "fp8_e4m3": fp8}[kv])
        pages = budget // (bpt * PAGE)
        rows.append({"variant": name, "ppl": round(ppl, 3), "agree": round(float((pred == ref_pred).float().mean()), 4),
                     "positions": int(pred.numel()), "weight_bytes": model.weight_bytes(),
                     "linear_weight_bytes": model.linear_weight_bytes(), "kv_bytes_per_token": bpt,
                     "max_seqs_2k": pages // (SEQ_LEN // PAGE), "eval_seconds": round(secs, 1)})
        print(f"  {name}: ppl {ppl:.3f} ({secs:.0f}s)", flush=True)
        del model

    base = next(r for r in rows if r["variant"] == "bf16")
    for r in rows:
        r["ppl_vs_bf16"] = round(r["ppl"] / base["ppl"] - 1, 4)
        r["linear_bytes_vs_bf16"] = round(r["linear_weight_bytes"] / base["linear_weight_bytes"], 4)
        r["kv_tokens_vs_bf16"] = round(base["kv_bytes_per_token"] / r["kv_bytes_per_token"], 4)
        r["max_seqs_vs_bf16"] = round(r["max_seqs_2k"] / base["max_seqs_2k"], 4)

    hdr = (f"{'variant':<22} {'ppl':>8} {'vs bf16':>8} {'agree':>7} {'weight MB':>10} {'linear MB':>10} "
           f"{'lin/bf16':>8} {'KV B/tok':>9} {'seqs@2k':>8} {'seqs/bf16':>9}")
    print(f"\n{model_dir.name}; held-out text: {text_name}, {args.chunks} x {args.chunk_len} tokens, "
          f"{rows[0]['positions']} positions; KV budget {args.budget_gib:g} GiB, page {PAGE}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['variant']:<22} {r['ppl']:>8.3f} {r['ppl_vs_bf16']:>+8.2%} {r['agree']:>7.2%} "
              f"{r['weight_bytes'] / 1e6:>10.1f} {r['linear_weight_bytes'] / 1e6:>10.1f} "
              f"{r['linear_bytes_vs_bf16']:>8.3f} {r['kv_bytes_per_token']:>9} {r['max_seqs_2k']:>8} "
              f"{r['max_seqs_vs_bf16']:>8.3f}x")
    print("fp8 KV rows: e4m3 K/V + one bf16 scale per (token, kv head), as the engine stores them")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": model_dir.name, "eval_text": text_name, "chunks": args.chunks, "chunk_len": args.chunk_len,
        "kv_budget_bytes": budget, "page_size": PAGE, "seq_len": SEQ_LEN,
        "quantize_seconds": {m: (round(s, 1) if s else None) for m, s in quant_secs.items()},
        "quant_configs": {m: json.loads((d / "config.json").read_text())["quantization_config"]
                          for m, d in quant_dirs.items()},
        "host": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
