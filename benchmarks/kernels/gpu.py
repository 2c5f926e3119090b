"""Kernel benchmarks on one GPU, each measured side by side with its baseline in the same run.

  W4A16 GEMM vs torch.matmul in bf16, M = 1..256 (powers of two), Llama-2-7B and Llama-2-70B layer shapes.
  Paged decode attention, FP8 (bf16 scales, as the engine stores them) vs bf16 KV cache, context 1k..32k,
  batch 1/32 (32 heads, 8 kv heads, d 128).
  Page checksum: device->host copy of KV pages vs host xxh3-64 over the same bytes.

Achieved bandwidth = bytes that must move (weights/KV + activations) / time, as a fraction of the
device's peak (H200: 4.8 TB/s; override with --peak-tbps). Without CUDA it prints why and exits 0.
Writes benchmarks/results/kernels.gpu.json.

  python -m benchmarks kernels.gpu [--quick] [--peak-tbps 4.8] [--gemm-m 1,16] [--contexts 1024,8192] [--out F]
  python -m benchmarks kernels.gpu --cpu-dry-run --out F   # the same steps, tiny shapes, Triton interpreter
                                                             # on CPU: proves the plumbing, times nothing real
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "kernels.gpu.json"
PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "L4": 0.3}
GROUP = 128
L2_DEFEAT_BYTES = 256 << 20

# name -> (K, N) of the linear layers, fused as an engine would run them
LLAMA_LAYERS = {
    "7b.qkv": (4096, 3 * 4096),
    "7b.o": (4096, 4096),
    "7b.gate_up": (4096, 2 * 11008),
    "7b.down": (11008, 4096),
    "70b.qkv": (8192, 8192 + 2 * 1024),
    "70b.o": (8192, 8192),
    "70b.gate_up": (8192, 2 * 28672),
    "70b.down": (28672, 8192),
}
GEMM_M = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
DECODE_BATCHES = (1, 32)
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
SCALE_DTYPE = torch.bfloat16   # fp8 scales as backend/engine/model_runner.py stores them

# --cpu-dry-run: tiny shapes under TRITON_INTERPRET=1 (set before the first triton import, in main)
DRY_LAYERS = {"tiny.qkv": (256, 96)}
DRY_GEMM_M = (1, 16)
DRY_CONTEXTS = (64, 200)
DRY_BATCHES = (1, 3)
DRY_DIMS = (4, 2, 32)          # heads, kv heads, head dim


def peak_bandwidth(override: float | None) -> tuple[float, str]:
    name = torch.cuda.get_device_name()
    if override:
        return override * 1e12, f"--peak-tbps {override}"
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps * 1e12, f"{key} datasheet"
    print(f"unknown device {name!r}: assuming 4.8 TB/s peak; pass --peak-tbps", file=sys.stderr)
    return 4.8e12, "assumed (unknown device)"


def copies_to_defeat_l2(nbytes: int) -> int:
    """Enough copies of an operand that rotating through them leaves none resident in L2 (50 MB on H100/H200)."""
    return max(1, min(128, math.ceil(L2_DEFEAT_BYTES / max(1, nbytes))))


def time_us_cpu(calls, quick: bool) -> tuple[float, float]:
    """--cpu-dry-run: wall time of two interpreted calls; proves the plumbing, measures nothing about a GPU."""
    t0 = time.perf_counter()
    for c in calls[:1] * 2:
        c()
    us = (time.perf_counter() - t0) / 2 * 1e6
    return us, us


def time_us(calls, quick: bool) -> tuple[float, float]:
    """-> (device us, host us) of one call. calls: the same op over distinct copies of its operands.

    device: CUDA-graph replay rotating through the copies (no launch overhead, cold L2), what an
    engine that captures its decode step sees. host: plain timed loop on one copy after an L2 flush
    (triton.testing.do_bench), including the Python launcher and launch latency.
    """
    import triton.testing

    rotation = itertools.cycle(calls)

    def step():
        next(rotation)()

    try:
        device_ms = triton.testing.do_bench_cudagraph(step, rep=20 if quick else 50)
    except RuntimeError as e:  # a capture failure is reported, not hidden
        print(f"    cuda graph capture failed ({e}); device time = plain timing", file=sys.stderr)
        device_ms = triton.testing.do_bench(step, warmup=10, rep=30 if quick else 100)
    host_ms = triton.testing.do_bench(calls[0], warmup=10 if quick else 25, rep=30 if quick else 100)
    return device_ms * 1e3, host_ms * 1e3


def bench_gemm(quick: bool, peak: float, gemm_m=GEMM_M, layers=None, device: str = "cuda", timer=None) -> list[dict]:
    from edgeinfer.kernels.w4a16_gemm import group_dequantize_tensor, group_quantize_tensor, w4a16_gemm_triton

    timer = timer or time_us
    rows = []
    if layers is None:
        layers = {k: v for k, v in LLAMA_LAYERS.items() if not quick or k in ("7b.qkv", "70b.down")}
    for name, (k, n) in layers.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        qweight, scales, zeros = group_quantize_tensor(w, GROUP)
        w_deq = group_dequantize_tensor(qweight, scales, zeros, GROUP).to(torch.bfloat16)
        bytes_w4 = qweight.numel() + 2 * scales.numel() + 2 * zeros.numel()
        int4_copies = [(qweight, scales, zeros)] + [
            (qweight.clone(), scales.clone(), zeros.clone()) for _ in range(copies_to_defeat_l2(bytes_w4) - 1)]
        bf16_copies = [w] + [w.clone() for _ in range(copies_to_defeat_l2(2 * w.numel()) - 1)]
        for m in gemm_m:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            out = w4a16_gemm_triton(x, qweight, scales, zeros, GROUP)
            ref = x @ w_deq.t()
            rel_err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            int4_calls = [functools.partial(w4a16_gemm_triton, x, *c, GROUP, out=out) for c in int4_copies]
            bf16_calls = [functools.partial(torch.matmul, x, c.t()) for c in bf16_copies]  # nn.Linear's x @ W.T
            t_int4, host_int4 = timer(int4_calls, quick)
            t_bf16, host_bf16 = timer(bf16_calls, quick)
            act = 2 * m * k + 2 * m * n
            flops = 2 * m * n * k
            r = dict(
                layer=name, M=m, K=k, N=n, rel_err_vs_dequant=rel_err,
                w4a16_us=t_int4, bf16_us=t_bf16, speedup=t_bf16 / t_int4,
                w4a16_host_us=host_int4, bf16_host_us=host_bf16, host_speedup=host_bf16 / host_int4,
                w4a16_bw_frac=(bytes_w4 + act) / (t_int4 * 1e-6) / peak,
                bf16_bw_frac=(2 * n * k + act) / (t_bf16 * 1e-6) / peak,
                w4a16_tflops=flops / (t_int4 * 1e-6) / 1e12, bf16_tflops=flops / (t_bf16 * 1e-6) / 1e12,
            )
            rows.append(r)
            print(f"  {name:12s} M={m:5d}  w4a16 {t_int4:9.1f} us ({r['w4a16_bw_frac']:5.1%} BW, "
                  f"{r['w4a16_tflops']:6.1f} TF)  bf16 {t_bf16:9.1f} us ({r['bf16_bw_frac']:5.1%} BW, "
                  f"{r['bf16_tflops']:6.1f} TF)  speedup {r['speedup']:5.2f}x  "
                  f"(host-timed {r['host_speedup']:5.2f}x)  err {rel_err:.1e}", flush=True)
        del w, w_deq, int4_copies, bf16_copies
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def make_decode_case(batch: int, context: int, fp8: bool, device: str = "cuda", dims=(HEADS, KV_HEADS, HEAD_DIM)):
    from edgeinfer import kernels

    heads, kv_heads, head_dim = dims
    pages_per_seq = math.ceil(context / PAGE_SIZE)
    num_pages = batch * pages_per_seq
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    shape = (num_pages, PAGE_SIZE, kv_heads, head_dim)
    k_cache = torch.empty(shape, device=device, dtype=dtype)
    v_cache = torch.empty(shape, device=device, dtype=dtype)
    k_scale = torch.empty(shape[:3], device=device, dtype=SCALE_DTYPE) if fp8 else None
    v_scale = torch.empty(shape[:3], device=device, dtype=SCALE_DTYPE) if fp8 else None
    gen = torch.Generator(device=device).manual_seed(0)
    chunk = 1 << 16  # fill through kv_store in chunks to bound the temporary bf16 rows
    for start in range(0, num_pages * PAGE_SIZE, chunk):
        slots = torch.arange(start, min(start + chunk, num_pages * PAGE_SIZE), device=device)
        kv = torch.randn(2, len(slots), kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        kernels.kv_store(kv[0], kv[1], k_cache, v_cache, slots, k_scale, v_scale)  # Triton on CUDA
    tables = torch.randperm(num_pages, device=device, generator=gen).int().reshape(batch, pages_per_seq)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    return q, k_cache, v_cache, tables, lens, k_scale, v_scale


def bench_decode(quick: bool, peak: float, contexts=DECODE_CONTEXTS, batches=DECODE_BATCHES, device: str = "cuda",
                 dims=(HEADS, KV_HEADS, HEAD_DIM), timer=None) -> list[dict]:
    from edgeinfer.kernels.paged_decode_attention import (
        paged_decode_attention_reference,
        paged_decode_attention_triton,
    )

    timer = timer or time_us
    heads, kv_heads, head_dim = dims
    rows = []
    for batch in batches:
        for context in contexts:
            result = dict(batch=batch, context=context)
            for fmt in ("bf16", "fp8"):
                q, k_cache, v_cache, tables, lens, k_scale, v_scale = make_decode_case(batch, context, fmt == "fp8",
                                                                                       device, dims)
                sm_scale = head_dim**-0.5
                out = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, sm_scale, k_scale, v_scale)
                if batch * context <= 32 * 8192:
                    ref = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, sm_scale, k_scale, v_scale)
                    result[f"{fmt}_max_err"] = (out.float() - ref.float()).abs().max().item()
                    del ref
                kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
                if k_scale is not None:
                    kv_bytes += 2 * batch * context * kv_heads * k_scale.element_size()
                caches = [(k_cache, v_cache, k_scale, v_scale)] + [
                    tuple(t.clone() if t is not None else None for t in (k_cache, v_cache, k_scale, v_scale))
                    for _ in range(copies_to_defeat_l2(kv_bytes) - 1)]
                calls = [functools.partial(paged_decode_attention_triton, q, kc, vc, tables, lens, sm_scale, ks, vs,
                                           out=out) for kc, vc, ks, vs in caches]
                t, host = timer(calls, quick)
                moved = kv_bytes + 2 * 2 * q.numel() + tables.numel() * 4
                result[f"{fmt}_us"] = t
                result[f"{fmt}_host_us"] = host
                result[f"{fmt}_bw_frac"] = moved / (t * 1e-6) / peak
                del q, k_cache, v_cache, k_scale, v_scale, out, caches, calls
                if device == "cuda":
                    torch.cuda.empty_cache()
            result["fp8_speedup"] = result["bf16_us"] / result["fp8_us"]
            rows.append(result)
            print(f"  batch={batch:3d} ctx={context:6d}  bf16 {result['bf16_us']:9.1f} us ({result['bf16_bw_frac']:5.1%} BW)"
                  f"  fp8 {result['fp8_us']:9.1f} us ({result['fp8_bw_frac']:5.1%} BW)"
                  f"  fp8 speedup {result['fp8_speedup']:5.2f}x", flush=True)
    return rows


def bench_checksum(quick: bool) -> dict:
    """Is GPU-side tagging worth it? Compare D2H copy time with host xxh3 over the same bytes."""
    import xxhash

    page_bytes = 2 * 32 * KV_HEADS * HEAD_DIM * PAGE_SIZE * 2  # K+V, 32 layers, bf16: one 8B-model page
    pages = 16 if quick else 64
    dev = torch.empty(pages * page_bytes, dtype=torch.uint8, device="cuda").random_()
    host = torch.empty(pages * page_bytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev)
    torch.cuda.synchronize()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
    copy_s = (time.perf_counter() - t0) / reps
    buf = host.numpy()
    t0 = time.perf_counter()
    for _ in range(reps):
        for p in range(pages):
            xxhash.xxh3_64_digest(memoryview(buf[p * page_bytes : (p + 1) * page_bytes]))
    hash_s = (time.perf_counter() - t0) / reps
    total = pages * page_bytes
    row = dict(page_bytes=page_bytes, pages=pages, d2h_gbps=total / copy_s / 1e9, xxh3_gbps_one_core=total / hash_s / 1e9,
               hash_over_copy=hash_s / copy_s)
    print(f"  page {page_bytes / 2**20:.1f} MiB x {pages}: D2H {row['d2h_gbps']:.1f} GB/s, "
          f"host xxh3 {row['xxh3_gbps_one_core']:.1f} GB/s per core (hash/copy time {row['hash_over_copy']:.2f})")
    return row


def ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def goals_of(gemm: list[dict], decode: list[dict]) -> dict:
    small_m = [r["speedup"] for r in gemm if r["M"] <= 16]
    at_8k = [r["fp8_speedup"] for r in decode if r["context"] == 8192]
    w4 = min(small_m) if small_m else None
    f8 = min(at_8k) if at_8k else None
    return dict(w4a16_min_speedup_m_le_16=w4, w4a16_goal=2.5, w4a16_met=w4 is not None and w4 >= 2.5,
                fp8_min_speedup_8k=f8, fp8_goal=1.6, fp8_met=f8 is not None and f8 >= 1.6)


def dry_run(out: Path) -> int:
    """Every step of the GPU run on CPU through the Triton interpreter, tiny shapes; JSON says dry_run."""
    import triton

    from edgeinfer.kernels import _triton

    if not _triton.INTERPRET:
        print("bench_kernels --cpu-dry-run: TRITON_INTERPRET=1 must be set before the first triton import")
        return 2
    print("DRY RUN on CPU (Triton interpreter, tiny shapes): timings are meaningless")
    gemm = bench_gemm(True, 1.0, DRY_GEMM_M, DRY_LAYERS, "cpu", time_us_cpu)
    decode = bench_decode(True, 1.0, DRY_CONTEXTS, DRY_BATCHES, "cpu", DRY_DIMS, time_us_cpu)
    report = dict(dry_run=True, device="cpu (TRITON_INTERPRET=1)", torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), w4a16_gemm=gemm, paged_decode=decode,
                  goals=goals_of(gemm, decode))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two layer shapes, fewer repetitions")
    parser.add_argument("--peak-tbps", type=float, default=None, help="device peak memory bandwidth, TB/s")
    parser.add_argument("--gemm-m", type=ints, default=GEMM_M, help="GEMM rows, comma-separated")
    parser.add_argument("--contexts", type=ints, default=DECODE_CONTEXTS, help="decode contexts, comma-separated")
    parser.add_argument("--no-checksum", action="store_true", help="skip the page checksum benchmark")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.cpu_dry_run:
        return dry_run(args.out)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; these benchmarks time Triton kernels on a GPU. Skipped.")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_kernels: CUDA is present but triton is not installed. Skipped.")
        return 0
    peak, peak_source = peak_bandwidth(args.peak_tbps)
    device = torch.cuda.get_device_name()
    print(f"device {device}, peak {peak / 1e12:.2f} TB/s ({peak_source}), torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print("W4A16 GEMM (asymmetric INT4, group 128) vs torch.matmul bf16:")
    gemm = bench_gemm(args.quick, peak, args.gemm_m)
    print(f"paged decode attention ({HEADS} heads, {KV_HEADS} kv heads, d {HEAD_DIM}, page {PAGE_SIZE}), FP8 vs bf16:")
    decode = bench_decode(args.quick, peak, args.contexts)
    checksum = None
    if not args.no_checksum:
        print("page checksum:")
        checksum = bench_checksum(args.quick)
    goals = goals_of(gemm, decode)

    def fmt(v):
        return "n/a" if v is None else f"{v:.2f}x"

    print(f"goals: W4A16 >= 2.5x at M <= 16: min {fmt(goals['w4a16_min_speedup_m_le_16'])} "
          f"({'met' if goals['w4a16_met'] else 'NOT met'}); FP8 decode >= 1.6x at 8k: min "
          f"{fmt(goals['fp8_min_speedup_8k'])} ({'met' if goals['fp8_met'] else 'NOT met'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(device=device, peak_bytes_per_s=peak, peak_source=peak_source, torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(), quick=args.quick,
                  fp8_scale_dtype=str(SCALE_DTYPE), w4a16_gemm=gemm, paged_decode=decode, page_checksum=checksum,
                  goals=goals)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
