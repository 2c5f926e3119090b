"""The multi-row CPU path side by side in ONE run at the same thread count: llama.cpp's llama-batched-bench
(aggregate decode at 8 / 32 sequences) and llama-bench (pp512), edgeinfer's engine as served
(benchmarks/peer_engine.py, a subprocess), and the per-layer kernels old vs new (benchmarks/bench_cpu_kernels.py,
a subprocess), the load average recorded around each part (the box is shared: ratios within a run matter).

  python benchmarks/bench_batched.py [--threads 1] [--npl 8,32] [--npp 128] [--ntg 32] [--skip-kernels]
      [--llamacpp-build /work/peers/llama-build] [--gguf PATH]

Writes benchmarks/results/bench_batched.json: every part's numbers and the ratios the goals name
(engine decode at B / batched-bench S_TG at B; engine pp512 / llama-bench pp512).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peer_llamacpp import batched_bench, llama_bench  # noqa: E402
from benchmarks.peer_servers import find_binary  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_batched.json"


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def part(name: str, fn) -> dict:
    print(f"-- {name} (load {load()})", file=sys.stderr, flush=True)
    before, t = load(), time.monotonic()
    try:
        out = fn()
    except (RuntimeError, ValueError, subprocess.SubprocessError) as e:   # JSONDecodeError is a ValueError
        out = {"error": str(e)[-2000:]}
    return {**out, "load_before": before, "load_after": load(), "wall_s": round(time.monotonic() - t, 1)}


def subprocess_json(cmd: list[str], threads: int, timeout_s: float, out_file: Path | None = None) -> dict:
    """Run a benchmark script; its result is the last stdout line as JSON, or out_file where given."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), "EDGEINFER_CPU_KERNELS": "ext"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}: {(p.stdout + p.stderr)[-2000:]}")
    text = out_file.read_text() if out_file is not None else p.stdout.strip().splitlines()[-1]
    return {"command": " ".join(cmd[1:]), "result": json.loads(text)}


def main() -> int:
    from edgeinfer.backend.model.gguf_import import default_gguf_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--npl", type=lambda s: [int(v) for v in s.split(",")], default=[8, 32])
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=32)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--llamacpp-build", type=Path, default=Path("/work/peers/llama-build"))
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    gguf = a.gguf or default_gguf_path()
    batched = find_binary("llama-batched-bench", a.llamacpp_build)
    bench = find_binary("llama-bench", a.llamacpp_build)
    result: dict = {"command": "python benchmarks/bench_batched.py " + " ".join(sys.argv[1:]), "threads": a.threads,
                    "gguf": str(gguf), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if batched is not None:
        result["llama_batched_bench"] = part("llama-batched-bench", lambda: batched_bench(
            batched, a.llamacpp_build, gguf, a.threads, a.npp, a.ntg, a.npl, 1800))
    result["edgeinfer_engine"] = part("edgeinfer engine", lambda: subprocess_json(
        [sys.executable, str(ROOT / "benchmarks" / "peer_engine.py"), "--pp", str(a.pp), "--tg", "32", "--npp",
         str(a.npp), "--ntg", str(a.ntg), "--npl", ",".join(map(str, a.npl)), "--reps", "1"], a.threads, 1800))
    if bench is not None:
        result["llama_bench"] = part("llama-bench", lambda: llama_bench(
            bench, a.llamacpp_build, gguf, a.threads, a.pp, 32, 1, 900))
    if not a.skip_kernels:
        with tempfile.TemporaryDirectory() as tmp:
            out_file = Path(tmp) / "kernels.json"
            result["kernels"] = part("bench_cpu_kernels", lambda: subprocess_json(
                [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_kernels.py"), "--threads", str(a.threads),
                 "--reps", "3", "--rows", "1,8,32,64,512", "--out", str(out_file)], a.threads, 1800, out_file))
    result["ratios"] = ratios(result, a.pp)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["ratios"], indent=1))
    return 0


def ratios(r: dict, pp: int) -> dict:
    out: dict = {}
    eng = r.get("edgeinfer_engine", {}).get("result", {})
    lbb = {row["batch"]: row for row in r.get("llama_batched_bench", {}).get("rows", [])}
    for b in eng.get("batched", []):
        peer = lbb.get(b["batch"])
        if peer:
            out[f"decode B={b['batch']}: engine / llama-batched-bench S_TG"] = round(
                b["decode_tok_s"] / peer["decode_tok_s"], 3)
            out[f"prefill B={b['batch']}: engine / llama-batched-bench S_PP"] = round(
                b["prefill_tok_s"] / peer["prefill_tok_s"], 3)
    for row in r.get("llama_bench", {}).get("rows", []):
        if row.get("test") == f"pp{pp}" and f"pp{pp}_tok_s" in eng:
            out[f"pp{pp}: engine / llama-bench"] = round(eng[f"pp{pp}_tok_s"] / row["tok_s"], 3)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
