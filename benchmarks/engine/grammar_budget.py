"""What a grammar costs per token, against the budget the engine holds it to (--grammar-mask-budget-ms, issue 53):
for each constraint, compiled with the default model's tokenizer as the engine compiles it, the per-token work
along the first allowed tokens (one token's mask for one request, and llguidance's forced-token scan that grammar
fast-forward runs after each token), medians and worst of --steps tokens, on one thread; and whether the engine's
compile-time probe refuses it (GrammarCompiler with the default budget).

  python -m benchmarks engine.grammar_budget [--steps 40]

Writes benchmarks/results/engine.grammar_budget.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.harness.results import ROOT, run_stamp, write_result

OUT = ROOT / "benchmarks" / "results" / "engine.grammar_budget.json"
TOOL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
CASES = [
    ("json_schema", "json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                                               "age": {"type": "integer"}},
                                               "required": ["name", "age"]})),
    ("tool call", "json_schema", json.dumps(TOOL)),
    ("regex [0-9]{1,4}", "regex", "[0-9]{1,4}"),
    ("regex (a|b)*c{100}", "regex", "(a|b)*c{100}"),
    ("regex ((x{20}){20}){20}", "regex", "((x{20}){20}){20}"),
    ("regex ((x{30}){30}){30}", "regex", "((x{30}){30}){30}"),
    ("regex ((ab{50}){50}){50}", "regex", "((ab{50}){50}){50}"),
    ("regex ((x{60}){60}){60}", "regex", "((x{60}){60}){60}"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cases", default="", help="comma-separated case labels (default: all)")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    from edgeinfer.backend.engine.grammar import GrammarCompiler, GrammarError, GrammarLimits, _first_allowed
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.protocol.tokenizer import Tokenizer
    from edgeinfer.protocol.wire import Constraint

    tok = Tokenizer.from_dir(ensure_native_default_model())
    vocab = tok.vocab_size
    budget = GrammarLimits().mask_budget_s
    measure = GrammarCompiler(tok, vocab, GrammarLimits(mask_budget_s=0))     # compiles everything, to time it
    served = GrammarCompiler(tok, vocab)                                      # the engine's: the budget applies
    wanted = {c for c in a.cases.split(",") if c}
    rows = {}
    for label, kind, spec in CASES:
        if wanted and label not in wanted:
            continue
        c = Constraint(kind, spec)
        t = time.perf_counter()
        m = measure.matcher(c)
        compile_ms = (time.perf_counter() - t) * 1e3
        masks, scans = [], []
        for _ in range(a.steps):
            t = time.perf_counter()
            mask = m.compute_bitmask()
            masks.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            m.deep_copy().compute_ff_tokens()
            scans.append((time.perf_counter() - t) * 1e3)
            nxt = _first_allowed(mask)
            if nxt is None or m.is_stopped() or not m.consume_token(nxt):
                break
        try:
            served.matcher(c)
            verdict = "accepted"
        except GrammarError as e:
            verdict = f"refused: {e}"
        rows[label] = {"compile_ms": round(compile_ms, 1), "tokens": len(masks),
                       "mask_ms_median": round(statistics.median(masks), 3), "mask_ms_max": round(max(masks), 3),
                       "ff_scan_ms_median": round(statistics.median(scans), 3), "ff_scan_ms_max": round(max(scans), 3),
                       "engine": verdict}
    measure.close()
    served.close()
    write_result({"bench": "engine.grammar_budget", "budget_ms": budget * 1e3, "threads": 1, "cases": rows,
                  **run_stamp(t0, load0)}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
