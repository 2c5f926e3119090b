"""How much does fp8 KV cost in perplexity at long context, and what does each scale layout buy?

The served default model (native INT4), CPython's idlelib/NEWS.txt, one window of each --lengths, every position
scored through the engine's paged pool (backend.quant.calib.paged_prefill), in one run:
  fp32            fp32 pages
  fp8             the default: e4m3 + a bf16 scale per token-head, q and k Hadamard-rotated (the kernels)
and with --ablations, at the first length, fake-quant variants (fp32 pages quantized then dequantized right
after the rope op stored them, by kernels.kv_store's quantizer): plain per token-head (the layout before), K only,
V only, K minus its per-channel mean from a calibration text ("K smoothing"), K rotated, K and V rotated.

  python -m benchmarks quality.fp8_kv [--lengths 4096,8192] [--ablations]

Writes benchmarks/results/quality.fp8_kv.json.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import run_stamp, write_result  # noqa: E402


def _ppl(model, ids: list[int], kv: str) -> float:
    import torch

    from edgeinfer.backend.quant.calib import paged_prefill

    with torch.inference_mode():
        hidden = paged_prefill(model, [ids], kv, 16)[:-1]
        nll = torch.nn.functional.cross_entropy(model.compute_logits(hidden).float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


class _FakeQuant:
    """The model's step ops, except that rope_kv_store_ quantizes and dequantizes (fp32 pages) the rows it stored:
    `which` of "k" / "v", minus `mean[layer]` for k, rotated by H / sqrt(d) when `rotate` names it."""

    def __init__(self, ops, cfg, which: str, mean=None, rotate: str = "") -> None:
        self.ops, self.cfg, self.which, self.mean, self.rotate, self.calls = ops, cfg, which, mean, rotate, 0

    def __getattr__(self, name: str):
        return getattr(self.ops, name)

    def rope_kv_store_(self, qkv, positions, cos, sin, k, v, slots, heads, kv_heads, ks=None, vs=None, hadamard=False):
        import torch

        from edgeinfer.kernels.cpu.attn_reference import hadamard_heads_
        from edgeinfer.kernels.kv_store import fp8_scale, quantize_fp8

        self.ops.rope_kv_store_(qkv, positions, cos, sin, k, v, slots, heads, kv_heads, ks, vs, hadamard)
        layer = self.calls % self.cfg.num_layers
        self.calls += 1
        d = self.cfg.head_dim
        for name, pool in (("k", k), ("v", v)):
            if name not in self.which:
                continue
            rows = pool.view(-1, kv_heads, d)[slots]
            shift = self.mean[layer] if self.mean is not None and name == "k" else torch.zeros(kv_heads, d)
            x = rows - shift
            if name in self.rotate:
                hadamard_heads_(x)
            s = fp8_scale(x, torch.bfloat16).float()
            y = quantize_fp8(x, s).float() * s[..., None]
            if name in self.rotate:
                hadamard_heads_(y)            # H / sqrt(d) is its own inverse
            pool.view(-1, kv_heads, d)[slots] = y + shift


def _ablations(model, ids: list[int], calib: list[int]) -> dict:
    import torch

    from edgeinfer.backend.quant.calib import paged_prefill

    ops, cfg = model.step_ops, model.cfg
    seen: dict[int, list] = {}

    class Capture(_FakeQuant):
        def rope_kv_store_(self, qkv, positions, cos, sin, k, v, slots, heads, kv_heads, ks=None, vs=None,
                           hadamard=False):
            self.ops.rope_kv_store_(qkv, positions, cos, sin, k, v, slots, heads, kv_heads, ks, vs, hadamard)
            seen.setdefault(self.calls % cfg.num_layers, []).append(k.view(-1, kv_heads, cfg.head_dim)[slots].clone())
            self.calls += 1

    model.step_ops = Capture(ops, cfg, "")
    try:
        with torch.inference_mode():
            paged_prefill(model, [calib], "fp32", 16)
    finally:
        model.step_ops = ops
    mean = {layer: torch.cat(rows).mean(0) for layer, rows in seen.items()}
    variants = {"fp8 plain (per token-head, before)": ("kv", None, ""), "fp8 K only": ("k", None, ""),
                "fp8 V only": ("v", None, ""), "fp8 K smoothing (calibrated channel means)": ("kv", mean, ""),
                "fp8 K rotated, V plain": ("kv", None, "k"), "fp8 K and V rotated": ("kv", None, "kv")}
    out = {}
    for label, (which, shift, rotate) in variants.items():
        model.step_ops = _FakeQuant(ops, cfg, which, shift, rotate)
        try:
            out[label] = _ppl(model, ids, "fp32")
        finally:
            model.step_ops = ops
        print(f"  {label}: {out[label]:.4f}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--ablations", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality.fp8_kv.json"))
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if max(lengths) > 8192:
        p.error("lengths above 8192 are past the default model's context")
    import torch

    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model
    from edgeinfer.backend.quant.calib import calibration_sources, eval_text
    from edgeinfer.protocol.tokenizer import Tokenizer

    t0, load0 = time.monotonic(), os.getloadavg()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    path = ensure_native_default_model()
    model, tok = load_model(path), Tokenizer.from_dir(path)
    text, source = eval_text()
    ids = tok.encode(text)
    result: dict = {"bench": "quality.fp8_kv", "host": platform.node(), "cpus": os.cpu_count(), "text": source,
                    "model": path.name, "ppl": {}, "fp8_over_fp32": {}}
    for n in lengths:
        row = {kv: _ppl(model, ids[:n], kv) for kv in ("fp32", "fp8_e4m3")}
        result["ppl"][str(n)] = row
        result["fp8_over_fp32"][str(n)] = row["fp8_e4m3"] / row["fp32"]
        print(f"{n} tokens: fp32 {row['fp32']:.4f}, fp8 {row['fp8_e4m3']:.4f}, "
              f"ratio {result['fp8_over_fp32'][str(n)]:.5f}", flush=True)
    if a.ablations:
        calib = tok.encode(calibration_sources("mix")[0][0])[:2048]
        abl = _ablations(model, ids[: lengths[0]], calib)
        base = result["ppl"][str(lengths[0])]["fp32"]
        result["ablations"] = {"length": lengths[0], "ppl": abl, "over_fp32": {k: v / base for k, v in abl.items()}}
    result.update(run_stamp(t0, load0))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
