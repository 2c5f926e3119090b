"""The served native model's decode step (`edgeinfer serve`'s defaults: SmolLM2-135M from the shipped GGUF, Q4_1
x8 linears, tied Q8_0 head) at B sequences, by part, with the x8 GEMMs' instruction-set levels (kernels.cpu.x8_isa)
alternated in ONE process: same engine, same sequences, rounds of `--steps-per-round` steps per level, so a noisy
shared box hits every level alike. Level 0 (AVX2 maddubs) is the pre-VNNI kernel code; the levels' outputs are
bit-identical (tests/backend/test_cpu_q4_kernels.py), so the sequences decode the same tokens on each.

  python benchmarks/bench_step_native.py [--batch 8,32] [--isa 0,3] [--threads 2] [--rounds 6]

Per (batch, level): median wall ms per step, and a breakdown in WALL ms per step (bench_step's timers around the
linears, the head, decode attention, rope + KV store, norms, sampling, the model's forward and the engine step).
Prints JSON lines; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--isa", default="0,3", help="x8_isa levels to alternate (0 AVX2 .. 3 AVX512-VNNI 512-bit)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=5)
    a = ap.parse_args()

    import torch

    import edgeinfer.kernels.cpu as kc
    from benchmarks import bench_step
    from benchmarks.peer_engine import served_engine
    from edgeinfer.backend.engine.engine import in_fresh_thread
    from edgeinfer.backend.model import linear
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    torch.set_num_threads(a.threads)
    bench_step.time = types.SimpleNamespace(process_time=time.perf_counter)   # the timers in wall time
    levels = [int(v) for v in a.isa.split(",")]

    def run() -> None:
        torch.set_grad_enabled(False)
        eng, _ = served_engine()
        best = kc.x8_isa()
        for b in (int(v) for v in a.batch.split(",")):
            g = torch.Generator().manual_seed(b)
            for i in range(b):
                prompt = torch.randint(100, 49000, (a.prompt_len,), generator=g).tolist()
                sp = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
                seq = eng._make_seq(GenerateRequest(f"b{b}-{i}", prompt, sp, "bench"), lambda chunk: None)
                eng._seqs[seq.request_id] = seq
                eng.scheduler.add(seq)
            while len(eng.scheduler.running) < b or any(s.is_prefilling for s in eng.scheduler.running):
                eng.step()
            for _ in range(3):
                eng.step()
            wall: dict[int, list[float]] = {lv: [] for lv in levels}
            parts: dict[int, dict[str, float]] = {lv: {} for lv in levels}
            load0 = os.getloadavg()[0]
            for r in range(a.rounds):
                for lv in levels:
                    kc.x8_isa(lv)
                    if r % 2:   # odd rounds instrumented, even rounds clean
                        timers = bench_step._instrument(eng.model)
                        timers.wrap(linear.Q8Linear, "forward", "head")
                        try:
                            for _ in range(a.steps_per_round):
                                eng.step()
                        finally:
                            timers.restore()
                        for k, v in timers.total.items():
                            parts[lv][k] = parts[lv].get(k, 0.0) + v
                    else:
                        for _ in range(a.steps_per_round):
                            t = time.perf_counter()
                            eng.step()
                            wall[lv].append(time.perf_counter() - t)
            n_inst = a.steps_per_round * (a.rounds // 2)
            for lv in levels:
                p = {k: v / n_inst * 1000 for k, v in parts[lv].items()}
                inside = sum(p.get(k, 0.0) for k in ("gemm", "head", "attention", "rope", "norms"))
                breakdown = {k: round(p.get(k, 0.0), 2) for k in ("gemm", "head", "attention", "rope", "norms",
                                                                   "sampling")}
                breakdown["model_other"] = round(p.get("model", 0.0) - inside, 2)
                breakdown["engine_outside_model"] = round(p.get("step", 0.0) - p.get("model", 0.0)
                                                          - p.get("sampling", 0.0), 2)
                print(json.dumps({"batch": b, "isa": kc.ISA_NAMES[lv], "threads": torch.get_num_threads(),
                                  "wall_ms": round(statistics.median(wall[lv]) * 1000, 2),
                                  "tok_s": round(b / statistics.median(wall[lv]), 1),
                                  "breakdown_wall_ms": breakdown, "load_avg": [load0, os.getloadavg()[0]]}),
                      flush=True)
            kc.x8_isa(best)
            for s in list(eng.scheduler.running):
                eng._finish(s, "abort")   # on this (the engine's) thread: frees its pages

    in_fresh_thread(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
