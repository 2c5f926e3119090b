"""Engine decode step time at B sequences, this tree vs a baseline tree (`--baseline-tree`, e.g. the main
checkout), measured alternately in fresh subprocesses (A B A B ...) so a noisy shared box hits both alike.

Per (tree, model, batch): median wall ms and median CPU ms (process time) of a decode step, aten ops per
step, and a breakdown of the step by part (GEMMs, attention, kv_store, norms, rope, sampling, the model's
other ops, and the engine/runner's Python and tensor building outside the model), measured in a separate
instrumented pass (timers around those functions; the clean pass has none). At batch 1 also the fraction of
this machine's read bandwidth (a 256 MiB sum) the step reaches: (weight bytes + KV bytes read) / step time.

  python -m benchmarks engine.step [--models fp32,/tmp/smol-w4] [--batch 1,8,32] [--steps 20] [--repeats 3]
                                  [--threads 1] [--baseline-tree /work/main] [--out F]

`fp32` is the default model; any other entry is a checkpoint directory (e.g. an INT4 one from
`edgeinfer model quantize`). Writes benchmarks/results/engine.step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "engine.step.json"
HERE = Path(__file__).resolve()


# ---------------------------------------------------------------- worker (runs inside the tree measured)

def submit_greedy(eng, rid: str, ids: list[int], max_tokens: int):
    """A greedy request (EOS ignored, output dropped) straight into eng's scheduler; the engine is stepped by the
    caller's thread. Returns its Sequence."""
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seq = eng._make_seq(GenerateRequest(rid, ids, sp, "bench"), lambda chunk: None)
    eng._seqs[seq.request_id] = seq
    eng.scheduler.add(seq)
    return seq


def decoding_engine(model, batch: int, prompt_len: int, num_pages: int = 2048, max_tokens: int = 10_000,
                    warmup: int = 3):
    """An engine on the caller's thread with `batch` sequences of random prompts (seeded by batch) prefilled in
    one step and `warmup` decode steps done: every later step() is a decode step of `batch` rows. Imports only
    edgeinfer, so a worker in another tree (--baseline-tree) can run it; engine.native_int4 uses it too."""
    import torch

    from edgeinfer.backend.engine.engine import LLMEngine
    from edgeinfer.backend.engine.engine_config import EngineConfig

    eng = LLMEngine(model, None, EngineConfig(max_num_seqs=max(64, batch), max_num_batched_tokens=4096,
                                              num_pages=num_pages))
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        submit_greedy(eng, f"b{i}", torch.randint(100, 49000, (prompt_len,), generator=g).tolist(), max_tokens)
    eng.step()                       # prefill
    for _ in range(warmup):          # warm-up decodes
        eng.step()
    assert len(eng.scheduler.running) == batch and all(not s.is_prefilling for s in eng.scheduler.running)
    return eng


class Timers:
    """Wraps functions with process-time accumulators, by part."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.undo: list = []

    def wrap(self, owner, name: str, part: str, static: bool = False) -> None:
        timed = _cpu_timed(getattr(owner, name), self.total, part)
        self.undo.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else None))
        setattr(owner, name, staticmethod(timed) if static else timed)

    def restore(self) -> None:
        for owner, name, old in reversed(self.undo):
            if name in ("step_ops", "lean_decode"):
                setattr(owner, name, old)
            elif old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


class _TimedOps:
    """A model's step_ops (kernels.cpu.attn) with each op timed into its part."""

    PARTS = {"decode_attention": "attention", "rope_kv_store_": "rope", "rms_norm": "norms", "add_rms_norm_": "norms"}

    def __init__(self, ops, timers: Timers) -> None:
        self._ops, self._timers = ops, timers

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        part = self.PARTS.get(name)
        if part is None:
            return fn
        return _cpu_timed(fn, self._timers.total, part)


def _cpu_timed(fn, total: dict, part: str):
    """fn, its CPU time added to total[part] on every call."""
    def timed(*args, **kwargs):
        t = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            total[part] += time.process_time() - t
    return timed


def _instrument(model=None) -> Timers:
    from edgeinfer import kernels
    from edgeinfer.backend.engine import engine as engine_mod
    from edgeinfer.backend.model import linear
    try:
        from edgeinfer.backend.model import decoder, layers
    except ImportError:   # a baseline tree from before backend/model/llama.py was split
        from edgeinfer.backend.model import llama as decoder  # type: ignore[no-redef]
        layers = decoder

    t = Timers()
    t.wrap(linear.DenseLinear, "forward", "gemm")
    t.wrap(linear.W4A16Linear, "forward", "gemm")
    t.wrap(kernels, "paged_decode_attention", "attention")
    t.wrap(kernels, "paged_prefill_attention", "attention")
    t.wrap(kernels, "kv_store", "kv_store")
    t.wrap(layers.RMSNorm, "forward", "norms")
    if "rotate" in layers.Rotary.__dict__:
        t.wrap(layers.Rotary, "rotate", "rope", static=True)
    else:
        t.wrap(layers.Rotary, "forward", "rope")
    t.wrap(layers.Rotary, "lookup", "rope")
    model_cls = getattr(decoder, "DecoderModel", None) or decoder.LlamaModel   # a baseline tree's older name
    t.wrap(model_cls, "forward", "model")
    t.wrap(model_cls, "compute_logits", "model")
    try:   # the step loop's module (engine/core.py since the engine was split), else a baseline tree's engine.py
        from edgeinfer.backend.engine import core as loop_mod
    except ImportError:
        loop_mod = engine_mod   # type: ignore[assignment]
    t.wrap(loop_mod, "sample", "sampling")
    t.wrap(engine_mod.LLMEngine, "step", "step")
    if getattr(model, "lean_decode", False):   # the timers sit on the module path: DecodePlan bypasses it
        t.undo.append((model, "lean_decode", True))
        model.lean_decode = False
    if getattr(model, "step_ops", None) is not None:   # rope_kv_store_ counts as rope (it includes the KV store)
        t.undo.append((model, "step_ops", model.step_ops))
        model.step_ops = _TimedOps(model.step_ops, t)
    return t


def _read_bandwidth() -> float:
    import torch

    x = torch.ones(64 * 1024 * 1024)   # 256 MiB
    best = min(_timed(x.sum) for _ in range(8))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _aten_ops_per_step(eng, steps: int = 3) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            eng.step()
    return sum(1 for e in p.events() if e.name.startswith(("aten::", "mkldnn::"))) / steps


def worker(args) -> dict:
    import torch

    from edgeinfer.backend.model.gguf_import import ensure_default_model
    try:
        from edgeinfer.backend.engine.loading import in_fresh_thread
        from edgeinfer.backend.model.loader import load_model
    except ImportError:   # a baseline tree from before the house step that split engine.py and llama.py
        from edgeinfer.backend.model.llama import load_model  # type: ignore[no-redef]

        from edgeinfer.backend.engine.engine import in_fresh_thread  # type: ignore[attr-defined,no-redef]

    torch.set_num_threads(args.threads)
    path = ensure_default_model() if args.model == "fp32" else Path(args.model)

    def run() -> dict:
        torch.set_grad_enabled(False)
        model = load_model(path)
        out: dict = {"weight_bytes": model.weight_bytes(), "rows": []}
        for b in args.batch:
            eng = decoding_engine(model, b, args.prompt_len)
            wall, cpu = [], []
            for _ in range(args.steps):
                w, c = time.perf_counter(), time.process_time()
                eng.step()
                wall.append(time.perf_counter() - w)
                cpu.append(time.process_time() - c)
            ctx = sum(s.num_computed_tokens for s in eng.scheduler.running)
            timers = _instrument(model)
            try:
                for _ in range(args.steps):
                    eng.step()
            finally:
                timers.restore()
            n = args.steps
            part = {k: v / n * 1000 for k, v in timers.total.items()}
            inside = sum(v for k, v in part.items() if k not in ("model", "step", "sampling"))
            breakdown = {k: round(part.get(k, 0.0), 3) for k in ("gemm", "attention", "kv_store", "norms", "rope",
                                                                 "sampling")}
            breakdown["model_other"] = round(part.get("model", 0.0) - inside, 3)
            breakdown["engine_python_and_inputs"] = round(part["step"] - part.get("model", 0.0)
                                                          - part.get("sampling", 0.0), 3)
            breakdown["instrumented_step"] = round(part["step"], 3)
            out["rows"].append({"batch": b, "wall_ms": statistics.median(wall) * 1000,
                                "cpu_ms": statistics.median(cpu) * 1000, "aten_ops_per_step": _aten_ops_per_step(eng),
                                "kv_bytes_read": ctx * eng.runner.bytes_per_token, "breakdown_cpu_ms": breakdown})
            del eng
        return out

    res = in_fresh_thread(run)
    res["read_bandwidth_gb_s"] = in_fresh_thread(_read_bandwidth)
    return res


# ---------------------------------------------------------------- driver

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="fp32,/tmp/smol-w4")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline-tree", default=None, help="a checkout to compare against (PYTHONPATH)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batch = [int(x) for x in str(args.batch).split(",")]
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    trees = {"this": str(HERE.parents[2])}
    if args.baseline_tree:
        trees["baseline"] = str(Path(args.baseline_tree).resolve())
    results: dict = defaultdict(list)
    for rep in range(args.repeats):
        for model in args.models.split(","):
            for name, tree in trees.items():   # alternate trees within each repeat
                cmd = [sys.executable, str(HERE), "--worker", "--model", model, "--batch", ",".join(map(str, args.batch)),
                       "--steps", str(args.steps), "--threads", str(args.threads), "--prompt-len", str(args.prompt_len)]
                env = dict(os.environ, PYTHONPATH=tree)
                p = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
                if p.returncode:
                    print(p.stderr[-3000:], file=sys.stderr)
                    return p.returncode
                res = json.loads(p.stdout.strip().splitlines()[-1])
                results[f"{name}|{model}"].append(res)
                for r in res["rows"]:
                    print(f"rep {rep} {name:8s} {model:14s} B={r['batch']:3d}  wall {r['wall_ms']:7.2f} ms  "
                          f"cpu {r['cpu_ms']:7.2f} ms  aten ops {r['aten_ops_per_step']:6.0f}  "
                          f"{r['breakdown_cpu_ms']}", flush=True)
    summary = []
    for key, runs in results.items():
        tree, model = key.split("|")
        for i, b in enumerate(args.batch):
            rows = [r["rows"][i] for r in runs]
            cpu = statistics.median(r["cpu_ms"] for r in rows)
            wall = statistics.median(r["wall_ms"] for r in rows)
            bw = statistics.median(r["read_bandwidth_gb_s"] for r in runs)
            read = runs[0]["weight_bytes"] + statistics.median(r["kv_bytes_read"] for r in rows)
            summary.append({"tree": tree, "model": model, "batch": b, "wall_ms": round(wall, 2), "cpu_ms": round(cpu, 2),
                            "tok_s_wall": round(b * 1000 / wall, 1), "aten_ops_per_step": rows[0]["aten_ops_per_step"],
                            "bytes_read_per_step": read, "read_bandwidth_gb_s": round(bw, 2),
                            "bandwidth_fraction_wall": round(read / (wall / 1000) / 1e9 / bw, 3),
                            "bandwidth_fraction_cpu": round(read / (cpu / 1000) / 1e9 / bw, 3),   # the step's own CPU time
                            "breakdown_cpu_ms": {k: round(statistics.median(r["breakdown_cpu_ms"][k] for r in rows), 3)
                                                 for k in rows[0]["breakdown_cpu_ms"]}})
    for s in summary:
        print(json.dumps(s))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.machine(), "threads": args.threads, "steps": args.steps,
                               "repeats": args.repeats, "prompt_len": args.prompt_len, "trees": trees,
                               "summary": summary, "runs": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
