"""Speculative decoding and grammar fast-forward: on against off, and against llama.cpp's lookup decoding.

  python -m benchmarks speculative [--levels 1,8,32] [--max-tokens 128] [--rounds 2] [--peers llamacpp]

Systems, all started at once and each wave run on each in turn (rounds interleaved: an idle server costs
nothing, and a slow moment of the machine falls on every system alike), over OpenAI HTTP (/v1/chat/completions, streaming, greedy):
  edgeinfer        `edgeinfer serve` with its defaults (n-gram drafts, adaptive; grammar fast-forward)
  edgeinfer-off    `edgeinfer serve --speculative off --backend-arg=--no-grammar-fast-forward`
  llamacpp         llama-server on the same GGUF, same threads, no speculation
  llamacpp-ngram   llama-server --spec-type ngram-simple (its prompt-lookup decoding)
Three kinds of prompt, each level a wave of that many concurrent requests (distinct prompts of the kind):
  copy        return a given code or JSON document unchanged / with one field changed (ignore_eos)
  structured  a tool call / a record as JSON under a json_schema response_format (ends when the schema does)
  free        a short story (ignore_eos)
Reported per system, kind and level: decode tok/s (completion tokens after the first over the window in which
tokens arrived), and for edgeinfer the draft tokens verified and accepted and the tokens fast-forwarded (its
backend's /metrics, deltas), for llama.cpp the draft counts its responses report (`timings.draft_n`,
`draft_n_accepted`) where present. Ratios on/off per system. Writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load  # noqa: E402
from benchmarks.harness.results import run_stamp, write_result  # noqa: E402
from benchmarks.harness.servers import (  # noqa: E402
    Running,
    ServerSpec,
    edgeinfer_spec,
    find_binary,
    free_port,
    llamacpp_spec,
)

OUT = ROOT / "benchmarks" / "results" / "speculative.json"
CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a window of the given size."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
RECORD = {"id": 1042, "name": "Ada Lovelace", "email": "ada@example.com", "status": "pending",
          "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"}}
TOOL_SCHEMA = {"type": "object", "properties": {
    "name": {"const": "create_ticket"},
    "arguments": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "priority": {"enum": ["low", "medium", "high"]},
        "assignee": {"type": "string", "maxLength": 20}, "labels": {"type": "array", "items": {"enum": [
            "bug", "feature", "docs"]}, "maxItems": 3}},
        "required": ["title", "priority", "assignee", "labels"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}


def prompts(kind: str, n: int) -> list[dict]:
    out = []
    for i in range(n):
        if kind == "copy":
            if i % 2:
                rec = dict(RECORD, id=1000 + i)
                msg = (f"Return this JSON exactly as it is, except that status is \"done\":\n{json.dumps(rec, indent=2)}")
            else:
                msg = f"Copy this code exactly, without any change (case {i}):\n\n{CODE}"
            out.append({"messages": [{"role": "user", "content": msg}], "ignore_eos": True})
        elif kind == "structured":
            msg = f"Open a ticket for bug #{100 + i}: the login page crashes on Safari. Call the tool."
            out.append({"messages": [{"role": "user", "content": msg}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "tool_call", "schema": TOOL_SCHEMA}}})
        else:
            msg = f"Write a short story (number {i}) about a lighthouse keeper who finds a message in a bottle."
            out.append({"messages": [{"role": "user", "content": msg}], "ignore_eos": True})
    return out


async def _one(session, url: str, key: str | None, model: str, body: dict, max_tokens: int) -> dict:
    req = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}, **body}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return await load.timed_stream(session, url, "/v1/chat/completions", headers, req)


async def wave(url: str, key: str | None, model: str, bodies: list[dict], max_tokens: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        got = await asyncio.gather(*[_one(s, url, key, model, b, max_tokens) for b in bodies])
    firsts = [g["times"][0] for g in got if g["times"]]
    lasts = [g["times"][-1] for g in got if g["times"]]
    tokens = sum(max(0, g["usage"].get("completion_tokens", len(g["times"])) - 1) for g in got)
    window = max(lasts) - min(firsts) if firsts else 0.0
    drafted = sum(g["timings"].get("draft_n", 0) for g in got)
    accepted = sum(g["timings"].get("draft_n_accepted", 0) for g in got)
    return {"decode_tok_s": tokens / window if window > 0 else None, "completion_tokens": tokens + len(firsts),
            "llama_draft_n": drafted, "llama_draft_accepted": accepted}


def backend_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("spec_drafted_tokens", "spec_accepted_tokens", "grammar_fast_forward_tokens"):
        m = re.search(rf"^edgeinfer_backend_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--kinds", default="copy,structured,free")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers", default="llamacpp", help="comma list: llamacpp, or '' for edgeinfer alone")
    p.add_argument("--llamacpp-build", type=Path, default=Path("/work/peers/llama-build"))
    p.add_argument("--llamacpp-venv", type=Path, default=Path("/work/peers/llamacpp"))
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    levels = [int(x) for x in a.levels.split(",") if x]
    kinds = [k for k in a.kinds.split(",") if k]
    from edgeinfer.backend.model.gguf_import import default_gguf_path

    specs: dict[str, tuple[ServerSpec, int | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("edgeinfer", []), ("edgeinfer-off", ["--speculative", "off",
                                                                   "--backend-arg=--no-grammar-fast-forward"])):
            spec = edgeinfer_spec(a.threads, home=Path(tmp) / name)
            bport = free_port()
            spec.cmd.extend(["--backend-port", str(bport), *extra])
            specs[name] = (spec, bport)
        skipped = {}
        if "llamacpp" in a.peers.split(","):
            if find_binary("llama-server", a.llamacpp_build, a.llamacpp_venv / "bin"):
                ctx = 1024 + a.max_tokens
                specs["llamacpp"] = (llamacpp_spec(a.threads, default_gguf_path(), a.llamacpp_build,
                                                   a.llamacpp_venv, max(levels), ctx), None)
                ngram = llamacpp_spec(a.threads, default_gguf_path(), a.llamacpp_build, a.llamacpp_venv,
                                      max(levels), ctx)
                ngram.cmd.extend(["--spec-type", "ngram-simple"])
                specs["llamacpp-ngram"] = (ngram, None)
            else:
                skipped["llamacpp"] = f"no llama-server under {a.llamacpp_build}"
        result: dict = {"bench": "speculative", "levels": levels, "kinds": kinds, "max_tokens": a.max_tokens,
                        "rounds": a.rounds, "threads": a.threads, "skipped": skipped, "systems": {}}
        with contextlib.ExitStack() as stack:       # every system up at once; each wave alternates between them
            running = {name: stack.enter_context(Running(spec, Path(tmp), 900.0)) for name, (spec, _) in specs.items()}
            for name, (spec, _) in specs.items():
                asyncio.run(wave(spec.url, spec.api_key, running[name].model, prompts("free", 1), 8))    # warm-up
                result["systems"][name] = {"command": " ".join(spec.cmd), "results": {}}
            for kind in kinds:
                for c in levels:
                    runs: dict[str, list[dict]] = {name: [] for name in specs}
                    for _ in range(a.rounds):
                        for name, (spec, bport) in specs.items():
                            before = backend_counters(f"http://127.0.0.1:{bport}") if bport else {}
                            w = asyncio.run(wave(spec.url, spec.api_key, running[name].model, prompts(kind, c),
                                                 a.max_tokens))
                            after = backend_counters(f"http://127.0.0.1:{bport}") if bport else {}
                            w.update({k: after[k] - before[k] for k in after})
                            runs[name].append(w)
                    for name, (_, bport) in specs.items():
                        extra = runs[name]
                        good = [x["decode_tok_s"] for x in extra if x["decode_tok_s"] is not None]
                        row = {"decode_tok_s": statistics.median(good) if good else None, "runs": extra}
                        if bport:
                            d = sum(x["spec_drafted_tokens"] for x in extra)
                            acc = sum(x["spec_accepted_tokens"] for x in extra)
                            toks = sum(x["completion_tokens"] for x in extra)
                            row.update({"acceptance": acc / d if d else None, "drafted": d, "accepted": acc,
                                        "fast_forwarded": sum(x["grammar_fast_forward_tokens"] for x in extra),
                                        "accepted_per_100_tokens": 100 * acc / toks if toks else None})
                        result["systems"][name]["results"][f"{kind}@{c}"] = row
                        print(f"  {name:15s} {kind:10s} c={c:<3d} {row['decode_tok_s'] or 0:7.1f} tok/s "
                              + (f"acceptance {row.get('acceptance') or 0:.2f}, fast-forwarded "
                                 f"{row.get('fast_forwarded', 0):.0f}" if bport else ""), flush=True)
    sysr = result["systems"]
    def ratio(x, y):
        return x / y if x and y else None

    ratios: dict = {}
    for on, off in (("edgeinfer", "edgeinfer-off"), ("llamacpp-ngram", "llamacpp")):
        if on in sysr and off in sysr:
            ratios[f"{on} / {off}"] = {k: ratio(sysr[on]["results"][k]["decode_tok_s"],
                                                sysr[off]["results"][k]["decode_tok_s"]) for k in sysr[on]["results"]}
    if "edgeinfer" in sysr and "llamacpp-ngram" in sysr:
        ratios["edgeinfer / llamacpp-ngram"] = {
            k: ratio(sysr["edgeinfer"]["results"][k]["decode_tok_s"], sysr["llamacpp-ngram"]["results"][k]["decode_tok_s"])
            for k in sysr["edgeinfer"]["results"]}
    result["ratios"] = ratios
    for label, row in ratios.items():
        print(f"  {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if v is not None))
    result.update(run_stamp(t0, load0))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
