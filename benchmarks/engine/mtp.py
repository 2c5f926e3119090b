"""What MTP drafting (`--speculative mtp`, backend/model/mtp.py) costs per step and what it gives back at a given
acceptance, measured side by side with plain decoding in one run, on random GLM-4.5-shaped checkpoints with an MTP
layer (tests/support/moe_checkpoints.build_mtp). No real MTP weights are reachable from these machines: a random MTP layer's
drafts are almost never accepted, so what is measured is the cost, and the gain is projected from it.

Modes, interleaved per round (medians over --rounds), for each --layers depth and B in --levels sequences (greedy,
--tokens tokens after a --prompt-len prompt, timed from the first decode step):
- off: plain decoding;
- mtp: the default adaptive policy (prior 0.8, then the sequence's own acceptance: here it stops drafting after a few
  misses, but the MTP layer still runs every step to keep its KV);
- mtp_always: a draft token verified every step (spec_adaptive off): the full per-step cost c = step time / plain
  step time of the MTP layer's forward plus one verify row.
With one draft token accepted at rate a a step emits 1 + a tokens, so the projected speedup is (1 + a) / c and the
break-even acceptance c - 1; reported at a = 0.85 (DeepSeek-V3's published MTP acceptance). Writes
benchmarks/results/engine.mtp.json.

  python -m benchmarks engine.mtp [--layers 3,12] [--levels 1,8] [--tokens 48] [--rounds 3] [--hidden 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.results import ROOT, run_stamp, write_result

OUT = ROOT / "benchmarks" / "results" / "engine.mtp.json"


def _decode(model, prompts: list[list[int]], tokens: int, **cfg) -> dict:
    from edgeinfer.backend.engine.engine import LLMEngine
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from tests.support.engine_steps import Stepper

    eng = LLMEngine(model, None, EngineConfig(kv_dtype="fp32", num_pages=len(prompts) * 16 + 16,
                                              max_num_seqs=len(prompts), **cfg))
    mtp_s = [0.0]
    if eng.runner.mtp is not None:
        runner = eng.runner.mtp
        step = runner.step

        def timed(items):
            t = time.perf_counter()
            out = step(items)
            mtp_s[0] += time.perf_counter() - t
            return out

        runner.step = timed  # type: ignore[method-assign]
    s = Stepper(eng)
    for i, p in enumerate(prompts):
        s.add(f"r{i}", p, tokens)
    while any(q.is_prefilling for q in eng.scheduler.running) or eng.scheduler.waiting:
        s.step()
    mtp_s[0] = 0.0
    steps0, t0 = eng.steps, time.perf_counter()
    s.run()
    dt = time.perf_counter() - t0
    emitted = sum(len(s.tokens[f"r{i}"]) - 1 for i in range(len(prompts)))
    return {"tok_s": emitted / dt, "steps": eng.steps - steps0, "emitted": emitted, "step_s": dt / (eng.steps - steps0),
            "drafted": eng.speculation.stats.drafted, "accepted": eng.speculation.stats.accepted, "mtp_share": mtp_s[0] / dt,
            "tokens": [s.tokens[f"r{i}"] for i in range(len(prompts))]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="3,12")
    p.add_argument("--levels", default="1,8")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    from edgeinfer.backend.engine.loading import in_fresh_thread
    from edgeinfer.backend.model.loader import load_model
    from tests.support import moe_checkpoints
    from tests.support.tiny import prompt

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    h = a.hidden
    shape = dict(hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h // 2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=h // 8, vocab_size=8192)
    tmp = Path(tempfile.mkdtemp(prefix="edgeinfer-mtp-"))
    levels = [int(x) for x in a.levels.split(",") if x]
    rows: dict = {}
    for depth in [int(x) for x in a.layers.split(",") if x]:
        d = tmp / f"l{depth}"
        moe_checkpoints.build_mtp("glm4_moe", d, layers=depth, **shape)
        with_mtp = in_fresh_thread(load_model, d, mtp=True)
        plain = in_fresh_thread(load_model, d)
        modes = {"off": (plain, {"speculative": "off"}), "mtp": (with_mtp, {"speculative": "mtp"}),
                 "mtp_always": (with_mtp, {"speculative": "mtp", "spec_adaptive": False})}
        for b in levels:
            prompts = [prompt(19 + i, a.prompt_len) for i in range(b)]
            got: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in range(a.rounds):
                for m, (model, cfg) in modes.items():
                    got[m].append(_decode(model, prompts, a.tokens, **cfg))
            for m in modes:      # speculation never changes greedy output
                assert all(r["tokens"] == got["off"][0]["tokens"] for r in got[m]), f"{m}: greedy output changed"
            step_ms = {m: statistics.median(r["step_s"] for r in got[m]) * 1e3 for m in modes}
            row: dict = {"off_tok_s": round(statistics.median(r["tok_s"] for r in got["off"]), 1),
                         "off_step_ms": round(step_ms["off"], 3)}
            for m in ("mtp", "mtp_always"):
                runs = got[m]
                drafted = sum(r["drafted"] for r in runs)
                seq_steps = sum(r["steps"] * b for r in runs)
                row[m] = {"tok_s": round(statistics.median(r["tok_s"] for r in runs), 1),
                          "ratio_vs_off": round(statistics.median(r["tok_s"] for r in runs) / row["off_tok_s"], 3),
                          "step_ms": round(step_ms[m], 3),
                          "acceptance": round(sum(r["accepted"] for r in runs) / drafted, 3) if drafted else None,
                          "drafted_per_seq_step": round(drafted / seq_steps, 3),
                          "mtp_layer_share_of_time": round(statistics.median(r["mtp_share"] for r in runs), 3)}
            c = step_ms["mtp_always"] / step_ms["off"]
            row["step_cost_with_a_draft_over_plain"] = round(c, 3)
            row["break_even_acceptance"] = round(c - 1, 3)
            row["projected_speedup_at_acceptance_0.85"] = round(1.85 / c, 3)
            rows[f"{depth}_layers/{b}"] = row
            print(f"  {depth:2d} layers, {b:2d} sequences: off {row['off_tok_s']:7.1f} tok/s | adaptive mtp "
                  f"{row['mtp']['ratio_vs_off']:.2f}x (acc {row['mtp']['acceptance']}) | a draft every step costs "
                  f"{c:.2f}x a plain step (MTP layer {row['mtp_always']['mtp_layer_share_of_time']:.0%} of the time): "
                  f"break-even acceptance {c - 1:.2f}, at 0.85 {1.85 / c:.2f}x", flush=True)
    result = {"bench": "engine.mtp", "model": f"random GLM-4.5-shaped + an MTP layer, hidden {h}, 16 experts top-4, "
                                               "vocab 8192, fp32 KV",
              "tokens": a.tokens, "prompt_len": a.prompt_len, "rounds": a.rounds, "threads": torch.get_num_threads(),
              "rows": rows}
    result.update(run_stamp(t0, load0))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
