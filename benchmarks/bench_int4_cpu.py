"""INT4 (w4a16-g64) decode on CPU, side by side in one run: the reference path (dequantize the whole weight
every call, fp32 GEMM) vs torch's CPU int4 GEMM on the prepacked weights, with the fp32 dense model
(oneDNN-prepacked) as the yardstick. Engine steps at B decoding sequences (64-token prompts), each model
timed on a fresh thread (one OpenMP pool, see backend.engine.engine.in_fresh_thread).

  python benchmarks/bench_int4_cpu.py [--batch 1,8,32] [--steps 10]

Quantizes SmolLM2 with RTN on first use (seconds), cached next to the model. Writes
benchmarks/results/bench_int4_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quality import quantized_dir  # noqa: E402

from edgeinfer.backend.engine.config import EngineConfig  # noqa: E402
from edgeinfer.backend.engine.engine import LLMEngine, in_fresh_thread  # noqa: E402
from edgeinfer.backend.model.gguf_import import ensure_default_model  # noqa: E402
from edgeinfer.backend.model.llama import load_model  # noqa: E402
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams  # noqa: E402

OUT = Path(__file__).parent / "results" / "bench_int4_cpu.json"


def step_ms(path: Path, prepack: bool, batch: int, steps: int) -> tuple[float, int]:
    model = load_model(path, prepack=prepack)
    eng = LLMEngine(model, None, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096, num_pages=512))
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(100, 49000, (64,), generator=g).tolist()
        sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        seq = eng._make_seq(GenerateRequest(f"b{i}", prompt, sp, "bench"), lambda chunk: None)
        eng._seqs[seq.request_id] = seq
        eng.scheduler.add(seq)
    eng.step()                    # prefill
    for _ in range(2):            # warm-up decodes
        eng.step()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t) / steps * 1000, model.linear_weight_bytes()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    model_dir = ensure_default_model()
    qdir, _ = quantized_dir(model_dir, "rtn", "w4a16-g64", "mix")
    variants = [("int4 reference", qdir, False), ("int4 cpu-gemm", qdir, True), ("fp32 dense", model_dir, True)]
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        row: dict = {"batch": b}
        for name, path, prepack in variants:
            ms, nbytes = in_fresh_thread(step_ms, path, prepack, b, args.steps)
            row[name] = {"step_ms": round(ms, 2), "tok_s": round(b * 1000 / ms, 1), "linear_weight_bytes": nbytes}
        row["cpu_gemm_over_reference"] = round(row["int4 reference"]["step_ms"] / row["int4 cpu-gemm"]["step_ms"], 2)
        row["cpu_gemm_over_fp32"] = round(row["fp32 dense"]["step_ms"] / row["int4 cpu-gemm"]["step_ms"], 2)
        rows.append(row)
        print(f"batch {b:3d}: " + "   ".join(f"{n} {row[n]['step_ms']:7.1f} ms/step" for n, _, _ in variants)
              + f"   int4 cpu-gemm is {row['cpu_gemm_over_reference']:.1f}x the reference, "
                f"{row['cpu_gemm_over_fp32']:.2f}x fp32 dense", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"model": model_dir.name, "quantized": qdir.name, "steps": args.steps,
                               "threads": torch.get_num_threads(), "machine": platform.machine(),
                               "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
