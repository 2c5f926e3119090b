"""What does each KV format cost in accuracy, measured the way the field measures it?

Per KV format against fp32 KV (the exact counterpart: same weights, same kernels), on the served default model
(native INT4), teacher-forced: every position of each window is scored through the engine's own paged pool and
kernels (backend.quant.calib.paged_prefill), on two texts:
  news      CPython's Lib/idlelib/NEWS.txt (the project's eval text)
  licenses  Debian's /usr/share/common-licenses GPL-3 + Apache-2.0 + MPL-2.0 + GFDL-1.3 (no other part of the
            project reads them; neither is the KV gate's calibration text, pydoc's topics)
at each --lengths, --windows consecutive windows from the text's start (llama-perplexity's chunks). Reported per
(text, length, format): perplexity ratio, mean / p99 / max KL divergence KL(fp32 || format) of the next-token
distributions, the mean over the second half of each window (the positions llama-perplexity scores), and the
same-top-1 rate.

--llamacpp-build DIR adds llama.cpp's own figure on the same GGUF and the same text files: `llama-perplexity`
with f16 KV saves the base logits (--kl-divergence-base), then q8_0 and q4_0 K+V (-fa on) are scored against it
(--kl-divergence), parsed from its output.

--greedy-prompts N adds a greedy check in vLLM's style over N chat prompts (benchmarks/data/chat_prompts.txt):
each format's greedy answer (--max-tokens) against fp32 KV's; at the first token where they part, is each side's
token within the other's top-5, and the logprob gap (fp32 KV's logprob of its own token minus of the format's
token, teacher-forced on the common prefix).

--four-bit L measures 4-bit KV layouts that are not built (fake quant: fp32 pages quantized and dequantized right
after the rope op stored them, K Hadamard-rotated as the served formats do) at length L, beside their bytes per
token-head and the 4k sequences they would fit against int8's: what a 4-bit KV would cost, before building one.

  python -m benchmarks quality.kv [--lengths 1024,4096,8192] [--windows 2] [--texts news,licenses]
      [--formats int8,fp8_e4m3,bf16] [--greedy-prompts 100] [--llamacpp-build DIR] [--llamacpp-lengths 1024,4096]
      [--four-bit 1024]

Writes benchmarks/results/quality.kv.json.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import run_stamp, write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "quality.kv.json"
LICENSES = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3")


def texts(names: list[str]) -> dict[str, tuple[str, str]]:
    out = {}
    for name in names:
        if name == "news":
            from edgeinfer.backend.quant.calib import eval_text

            out[name] = eval_text()
        elif name == "licenses":
            base = Path("/usr/share/common-licenses")
            missing = [f for f in LICENSES if not (base / f).is_file()]
            if missing:
                raise SystemExit(f"--texts licenses needs {', '.join(str(base / f) for f in missing)} (Debian's "
                                 f"base-files)")
            out[name] = ("\n\n".join((base / f).read_text() for f in LICENSES),
                         f"{base}/{{{','.join(LICENSES)}}}")
        else:
            raise SystemExit(f"unknown text {name!r}: news, licenses")
    return out


def logprobs(model, ids: list[int], kv: str):
    from edgeinfer.backend.quant.kv_gate import logprobs as paged_logprobs

    return paged_logprobs(model, ids, kv)


def scores(ref, got, ids: list[int]) -> dict:
    """Per-position KL(ref || got), top-1 agreement and the next-token NLL of both (the gate's own measure)."""
    from edgeinfer.backend.quant.kv_gate import position_scores

    return position_scores(ref, got, ids)


def summary(parts: list[dict], n: int) -> dict:
    import torch

    kld = torch.cat([p["kld"] for p in parts])
    half = torch.cat([p["kld"][n // 2:] for p in parts])
    nll, nll_ref = torch.cat([p["nll"] for p in parts]), torch.cat([p["nll_ref"] for p in parts])
    return {"ppl_ratio": round(math.exp(float(nll.mean() - nll_ref.mean())), 5),
            "kld_mean": round(float(kld.mean()), 6), "kld_p99": round(float(kld.quantile(0.99)), 6),
            "kld_max": round(float(kld.max()), 5), "kld_mean_second_half": round(float(half.mean()), 6),
            "same_top1": round(float(torch.cat([p["top1"] for p in parts]).mean()), 5),
            "ppl_fp32kv": round(math.exp(float(nll_ref.mean())), 4)}


def teacher_forced(model, tok, named: dict, lengths: list[int], windows: int, formats: list[str]) -> dict:
    out: dict = {}
    for name, (text, _) in named.items():
        ids = tok.encode(text)
        out[name] = {"tokens": len(ids)}
        for n in lengths:
            if len(ids) < n * windows:
                out[name][str(n)] = {"skipped": f"text has {len(ids)} tokens, {windows} x {n} needed"}
                continue
            parts: dict[str, list] = {f: [] for f in formats}
            t = time.monotonic()
            for w in range(windows):
                window = ids[w * n:(w + 1) * n]
                ref = logprobs(model, window, "fp32")
                for f in formats:
                    parts[f].append(scores(ref, logprobs(model, window, f), window))
                del ref
            out[name][str(n)] = {f: summary(parts[f], n) for f in formats}
            for f in formats:
                s = out[name][str(n)][f]
                print(f"{name} {n:>5} {f:>9}: ppl x{s['ppl_ratio']:.4f}  KLD mean {s['kld_mean']:.5f} "
                      f"p99 {s['kld_p99']:.4f}  same top-1 {s['same_top1']:.2%}", flush=True)
            print(f"  ({time.monotonic() - t:.0f} s)", flush=True)
    return out


# ---------------------------------------------------------------- 4-bit layouts, by fake quant

def fake_quant(x, bits: int, group: int, asym: bool):
    """x [..., d] -> quantized and dequantized per group of `group` values (scales, and mins, rounded to bf16)."""
    import torch

    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // group, group)
    if asym:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        qmax = 2 ** bits - 1
        scale = ((hi - lo).clamp_min(1e-8) / qmax).to(torch.bfloat16).float()
        lo = lo.to(torch.bfloat16).float()
        q = ((g - lo) / scale).round().clamp(0, qmax)
        return (q * scale + lo).reshape(shape)
    qmax = 2 ** (bits - 1) - 1
    scale = (g.abs().amax(-1, keepdim=True).clamp_min(1e-8) / qmax).to(torch.bfloat16).float()
    return ((g / scale).round().clamp(-qmax, qmax) * scale).reshape(shape)


# name: (K (bits, group, asym), V (bits, group, asym), V rotated too); head_dim 64 on the default model
FOUR_BIT = {
    "int8 per token-head (served, as fake quant)": ((8, 64, False), (8, 64, False), False),
    "K8 + V4 asym g32": ((8, 64, False), (4, 32, True), False),
    "K8 + V4 asym g32, V rotated": ((8, 64, False), (4, 32, True), True),
    "K4 + V4 sym g64 (one scale per token-head)": ((4, 64, False), (4, 64, False), False),
    "K4 + V4 asym g64": ((4, 64, True), (4, 64, True), False),
    "K4 + V4 asym g64, V rotated": ((4, 64, True), (4, 64, True), True),
    "K4 + V4 asym g32": ((4, 32, True), (4, 32, True), False),
    "K4 + V4 sym g16": ((4, 16, False), (4, 16, False), False),
}


def _bytes(spec: tuple[int, int, bool], d: int) -> float:
    bits, group, asym = spec
    return d * bits / 8 + d // group * (4 if asym else 2)


class _FakeQuantKV:
    """The model's step ops, except that rope_kv_store_ quantizes and dequantizes the fp32 rows it stored."""

    def __init__(self, ops, cfg, k_spec, v_spec, rotate_v: bool) -> None:
        self.ops, self.cfg, self.k_spec, self.v_spec, self.rotate_v = ops, cfg, k_spec, v_spec, rotate_v

    def __getattr__(self, name: str):
        return getattr(self.ops, name)

    def rope_kv_store_(self, qkv, positions, cos, sin, k, v, slots, heads, kv_heads, ks=None, vs=None, hadamard=False):
        from edgeinfer.kernels.cpu.attn_reference import hadamard_heads_

        self.ops.rope_kv_store_(qkv, positions, cos, sin, k, v, slots, heads, kv_heads, ks, vs, hadamard)
        d = self.cfg.head_dim
        # V rotated too: o = p (V H) H, the output rotated back (a real kernel would rotate o once per head)
        for pool, spec, rotate in ((k, self.k_spec, True), (v, self.v_spec, self.rotate_v)):
            rows = pool.view(-1, kv_heads, d)[slots]
            if rotate:
                hadamard_heads_(rows)
            y = fake_quant(rows, *spec)
            if rotate:
                hadamard_heads_(y)                 # H / sqrt(d) is its own inverse
            pool.view(-1, kv_heads, d)[slots] = y


def four_bit(model, tok, named: dict, n: int) -> dict:
    cfg, ops = model.cfg, model.step_ops
    if ops is None or cfg.mla is not None:
        return {"skipped": "needs the CPU step ops and a K/V (not MLA) model"}
    d = cfg.head_dim
    int8_bytes = 2 * (d + 2)
    out: dict = {"length": n, "int8_bytes_per_token_head": int8_bytes}
    for name, (text, _) in named.items():
        ids = tok.encode(text)[:n]
        ref = logprobs(model, ids, "fp32")
        out[name] = {}
        for label, (ks, vs, rotate_v) in FOUR_BIT.items():
            model.step_ops = _FakeQuantKV(ops, cfg, ks, vs, rotate_v)
            try:
                got = logprobs(model, ids, "fp32")
            finally:
                model.step_ops = ops
            row = summary([scores(ref, got, ids)], n)
            per = _bytes(ks, d) + _bytes(vs, d)
            out[name][label] = {**row, "bytes_per_token_head": per, "seqs_over_int8": round(int8_bytes / per, 3)}
            print(f"4-bit {name} {label}: KLD {row['kld_mean']:.5f}, top-1 {row['same_top1']:.2%}, "
                  f"{per:.0f} B/token-head ({int8_bytes / per:.2f}x int8's sequences)", flush=True)
    return out


# ---------------------------------------------------------------- llama.cpp's own figure

def _parse_kld(text: str) -> dict:
    """llama-perplexity --kl-divergence's summary: Mean PPL ratio, Mean KLD, 99.0% KLD, Maximum KLD, Same top p."""
    def grab(label: str) -> float | None:
        m = re.search(rf"^{re.escape(label)}\s*:\s*([-\d.eE+]+)", text, re.M)
        return float(m.group(1)) if m else None

    same = re.search(r"^Same top p\s*:\s*([\d.]+)", text, re.M)
    return {"ppl_ratio": grab("Mean PPL(Q)/PPL(base)"), "kld_mean": grab("Mean    KLD"),
            "kld_p99": grab("99.0%   KLD"), "kld_max": grab("Maximum KLD"),
            "same_top1": float(same.group(1)) / 100 if same else None}


def llamacpp(build: Path, named: dict, lengths: list[int], windows: int, threads: int) -> dict:
    from benchmarks.harness.servers import find_binary
    from edgeinfer.backend.model.gguf_import import default_gguf_path

    exe = find_binary("llama-perplexity", build, build / "bin")
    if exe is None:
        raise SystemExit(f"no llama-perplexity under {build}")
    gguf = default_gguf_path()
    out: dict = {"gguf": gguf.name, "base": "f16 KV", "binary": str(exe)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (text, _) in named.items():
            f = Path(tmp) / f"{name}.txt"
            f.write_text(text)
            out[name] = {}
            for n in lengths:
                base = Path(tmp) / f"{name}-{n}.kld"
                common = [str(exe), "-m", str(gguf), "-f", str(f), "-c", str(n), "-b", str(min(n, 2048)),
                          "--chunks", str(windows), "-t", str(threads), "-fa", "on"]
                r = subprocess.run([*common, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(base)],
                                   capture_output=True, text=True, timeout=7200)
                if r.returncode != 0:
                    out[name][str(n)] = {"error": r.stderr[-1500:]}
                    continue
                row = {}
                for kv in ("q8_0", "q4_0"):
                    r = subprocess.run([*common, "-ctk", kv, "-ctv", kv, "--kl-divergence-base", str(base),
                                        "--kl-divergence"], capture_output=True, text=True, timeout=7200)
                    row[kv] = _parse_kld(r.stdout + r.stderr) if r.returncode == 0 else {"error": r.stderr[-1500:]}
                    print(f"llama.cpp {name} {n:>5} {kv}: {row[kv]}", flush=True)
                out[name][str(n)] = row
                base.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------- greedy check (vLLM's check_logprobs_close)

def _answers(path: Path, kv: str, ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    eng = load_engine(path, EngineConfig(kv_dtype=kv))
    eng.start()

    async def one(i: int, p: list[int]) -> list[int]:
        out: list[int] = []
        req = GenerateRequest(f"kv-{kv}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0), f"ns{i}")
        async for ch in eng.generate(req):
            out += ch.token_ids
        return out

    async def every():
        return list(await asyncio.gather(*[one(i, p) for i, p in enumerate(ids)]))

    try:
        return asyncio.run(every())
    finally:
        eng.stop()


def greedy(model, path: Path, tok, n: int, max_tokens: int, formats: list[str]) -> dict:
    from benchmarks.quality.chat_agreement import prompts

    ids = [list(tok.encode_chat([{"role": "user", "content": t}])) for t in prompts()[:n]]
    ref = _answers(path, "fp32", ids, max_tokens)
    out = {"prompts": len(ids), "max_tokens": max_tokens}
    for f in formats:
        got = _answers(path, f, ids, max_tokens)
        firsts = []
        for p, a, b in zip(ids, ref, got):
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is None:
                continue
            ctx = p + a[:i]                        # the common prefix: both formats saw these tokens
            lr, lf = logprobs(model, ctx, "fp32")[-1], logprobs(model, ctx, f)[-1]
            firsts.append({"position": i, "ref_token_in_format_top5": a[i] in lf.topk(5).indices.tolist(),
                           "format_token_in_ref_top5": b[i] in lr.topk(5).indices.tolist(),
                           "logprob_gap": round(float(lr[a[i]] - lr[b[i]]), 4)})
        same = sum(a == b for a, b in zip(ref, got))
        out[f] = {"same_answer": same / len(ids), "divergences": len(firsts),
                  "both_in_top5": sum(d["ref_token_in_format_top5"] and d["format_token_in_ref_top5"]
                                      for d in firsts),
                  "max_logprob_gap": max((d["logprob_gap"] for d in firsts), default=0.0),
                  "first_divergences": firsts}
        print(f"greedy {f:>9}: same answer {same}/{len(ids)}, first divergences {len(firsts)}, both in the other's "
              f"top-5 {out[f]['both_in_top5']}, max gap {out[f]['max_logprob_gap']:.3f} nats", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--texts", default="news,licenses")
    p.add_argument("--formats", default="int8,fp8_e4m3,bf16")
    p.add_argument("--greedy-prompts", type=int, default=100, help="0: no greedy check")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--llamacpp-build", type=Path, default=None)
    p.add_argument("--llamacpp-lengths", default="1024,4096",
                   help="llama.cpp's lengths (its q4_0 KV at 8k ran past 18 minutes here)")
    p.add_argument("--four-bit", type=int, default=0, help="length of the 4-bit fake-quant measurement (0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",") if x]
    formats = [x for x in a.formats.split(",") if x]
    if max(lengths) > 8192:
        p.error("lengths above 8192 are past the default model's context")
    import torch

    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model
    from edgeinfer.protocol.tokenizer import Tokenizer

    t0, load0 = time.monotonic(), os.getloadavg()
    torch.set_num_threads(a.threads)
    path = ensure_native_default_model()
    model, tok = load_model(path), Tokenizer.from_dir(path)
    named = texts([x for x in a.texts.split(",") if x])
    result: dict = {"bench": "quality.kv", "host": platform.node(), "cpus": os.cpu_count(), "model": path.name,
                    "against": "fp32 KV, same weights and kernels", "texts": {k: v[1] for k, v in named.items()},
                    "windows": a.windows, "formats": formats}
    result["teacher_forced"] = teacher_forced(model, tok, named, lengths, a.windows, formats)
    if a.four_bit:
        result["four_bit_fake_quant"] = four_bit(model, tok, named, a.four_bit)
    if a.llamacpp_build:
        result["llamacpp"] = llamacpp(a.llamacpp_build, named, [int(x) for x in a.llamacpp_lengths.split(",") if x],
                                      a.windows, a.threads)
    if a.greedy_prompts:
        result["greedy"] = greedy(model, path, tok, a.greedy_prompts, a.max_tokens, formats)
    result.update(run_stamp(t0, load0))
    write_result(result, a.out, echo=False)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
