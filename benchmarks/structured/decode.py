"""Grammar-constrained vs unconstrained decode in the engine, side by side in one run, and grammar compile
time (first and cached). Writes benchmarks/results/structured.decode.json.

Decode tok/s at 1 and 8 concurrent sequences: the same prompts and max_tokens, unconstrained (ignore_eos)
vs constrained by a JSON Schema whose minItems keeps it open for the whole run (so both decode exactly
`--new-tokens`); decode time = total - time to the last first token. The two are alternated `--reps`
times and the median is kept (the CPUs are shared). Also the per-step cost of the batch mask alone
(apply_masks: llguidance's parallel mask + one masked_fill), and compile times of three schemas: first
compile, then a cached hit (a deep copy of the compiled prototype).

  python -m benchmarks structured.decode [--new-tokens 32] [--prompt-len 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.grammar import GrammarCompiler, apply_masks
from edgeinfer.backend.engine.loading import load_engine
from edgeinfer.backend.model.gguf_import import ensure_default_model
from edgeinfer.protocol.wire import Constraint, GenerateRequest, SamplingParams

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "structured.decode.json"

ROWS = {"type": "array", "minItems": 200, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}}}}
SCHEMAS = {
    "small": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "pydantic_like": {"$defs": {"Addr": {"type": "object", "properties": {
        "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "zip"], "additionalProperties": False}},
        "type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "home"],
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
                       "home": {"$ref": "#/$defs/Addr"}, "email": {"type": ["string", "null"]}}},
    "wide_enums": {"type": "object", "properties": {f"p{i}": {"enum": [f"v{i}_{j}" for j in range(40)]}
                                                    for i in range(60)}},
}


async def batch(eng: LLMEngine, prompts: list[list[int]], new: int, ns: str, c: Constraint | None) -> float:
    """Decode tokens/s of the batch: tokens after the first, over the time after the last first token."""
    t0 = time.perf_counter()
    firsts: list[float] = []
    counts: list[int] = []

    async def one(i: int, p: list[int]) -> None:
        req = GenerateRequest(f"{ns}-{i}", p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), ns,
                              constraint=c)
        n = 0
        async for ch in eng.generate(req):
            if n == 0:
                firsts.append(time.perf_counter() - t0)
            n += len(ch.token_ids)
        counts.append(n)

    await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    total = time.perf_counter() - t0
    assert all(n == new for n in counts), f"a sequence stopped early: {counts}"
    return sum(n - 1 for n in counts) / (total - max(firsts))


def compile_times(eng: LLMEngine) -> dict:
    fresh = GrammarCompiler(eng.tokenizer, eng.model.cfg.vocab_size)      # type: ignore[arg-type]
    t0 = time.perf_counter()
    assert fresh.lltok.vocab_size > 0
    out: dict = {"llg_tokenizer_build_s": round(time.perf_counter() - t0, 4)}

    async def go() -> None:
        for name, s in SCHEMAS.items():
            c = Constraint("json_schema", json.dumps(s))
            t0 = time.perf_counter()
            await fresh.matcher_async(c)
            t1 = time.perf_counter()
            await fresh.matcher_async(c)
            t2 = time.perf_counter()
            out[name] = {"first_ms": round((t1 - t0) * 1e3, 3), "cached_ms": round((t2 - t1) * 1e3, 4)}

    asyncio.run(go())
    fresh.close()
    return out


def mask_cost(eng: LLMEngine, n: int, reps: int = 50) -> float:
    g = eng.grammars
    assert g is not None
    ms = [(i, g.matcher(Constraint("json_schema", json.dumps(ROWS)))) for i in range(n)]
    logits = torch.randn(n, eng.model.cfg.vocab_size)
    t0 = time.perf_counter()
    for _ in range(reps):
        apply_masks(g, ms, logits)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    eng = load_engine(ensure_default_model(), EngineConfig(max_num_seqs=8, kv_cache_bytes=256 << 20))
    rows = Constraint("json_schema", json.dumps(ROWS))
    eng.start()
    try:
        result: dict = {"machine": platform.machine(), "torch_threads": torch.get_num_threads(),
                        "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "reps": args.reps,
                        "compile": compile_times(eng), "decode": {}, "mask_ms_per_step": {}}
        g = torch.Generator().manual_seed(0)
        k = 0
        for n in [int(x) for x in args.concurrency.split(",")]:
            free, cons = [], []
            for _ in range(args.reps):
                for c, acc in ((None, free), (rows, cons)):
                    prompts = [torch.randint(100, 49000, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
                    acc.append(asyncio.run(batch(eng, prompts, args.new_tokens, f"b{k}", c)))
                    k += 1
            f, s = statistics.median(free), statistics.median(cons)
            result["decode"][str(n)] = {"unconstrained_tok_s": round(f, 2), "constrained_tok_s": round(s, 2),
                                        "constrained_over_unconstrained": round(s / f, 3),
                                        "runs_unconstrained": [round(x, 2) for x in free],
                                        "runs_constrained": [round(x, 2) for x in cons]}
            result["mask_ms_per_step"][str(n)] = round(mask_cost(eng, n), 3)
            print(n, result["decode"][str(n)], "mask ms", result["mask_ms_per_step"][str(n)], flush=True)
    finally:
        eng.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
