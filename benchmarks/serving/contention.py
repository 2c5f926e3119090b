"""Decode beside a CPU hog: does a server slow down in proportion to the cores it loses, or collapse?

  python -m benchmarks serving.contention [--peers llamacpp] [--llamacpp-build DIR] [--levels 1,8] [--rounds 2]

Each system (edgeinfer as `edgeinfer serve` with its defaults; llama.cpp's llama-server on the same GGUF with the
same threads) is started once; at each concurrency level it runs a wave of streaming /v1/completions (greedy,
ignore_eos, --max-tokens each) alone, then the same wave while a busy loop (a `python -c "while True: pass"`
child pinned to the last CPU of this process's affinity) holds one core, alternating for --rounds. Reported
per level: decode tok/s alone and beside the hog (medians), hogged / alone, and edgeinfer / llama.cpp beside
the hog. On a 2-core machine losing a core should cost about half (or less, where a step is memory-bound),
never 98 %. Writes benchmarks/results/serving.contention.json (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load  # noqa: E402
from benchmarks.harness.results import run_stamp, write_result  # noqa: E402
from benchmarks.harness.servers import Running, edgeinfer_spec, find_binary, llamacpp_spec  # noqa: E402
from benchmarks.peers import Prompts, prompt_tokens, tokenizer  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "serving.contention.json"


class Hog:
    """A busy loop on one CPU (the last one this process may use), stopped by pid."""

    def __enter__(self) -> Hog:
        cpu = max(os.sched_getaffinity(0))
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        self.cpu = cpu
        time.sleep(1.0)   # a second of it before measuring: what a server sees a while after a neighbour starts
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default="llamacpp", help="comma list: llamacpp, or '' for edgeinfer alone")
    p.add_argument("--llamacpp-build", type=Path, default=Path("/work/peers/llama-build"))
    p.add_argument("--llamacpp-venv", type=Path, default=Path("/work/peers/llamacpp"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--levels", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    levels = [int(x) for x in a.levels.split(",") if x]
    from edgeinfer.backend.model.gguf_import import default_gguf_path, ensure_native_default_model

    prompts = Prompts(prompt_tokens(tokenizer(ensure_native_default_model())))
    specs = {"edgeinfer": edgeinfer_spec(a.threads)}
    skipped = {}
    if "llamacpp" in a.peers.split(","):
        if find_binary("llama-server", a.llamacpp_build, a.llamacpp_venv / "bin"):
            specs["llamacpp"] = llamacpp_spec(a.threads, default_gguf_path(), a.llamacpp_build, a.llamacpp_venv,
                                              max(levels), 32 + a.max_tokens + 16)
        else:
            skipped["llamacpp"] = f"no llama-server under {a.llamacpp_build}"
    result: dict = {"bench": "serving.contention", "threads": a.threads, "levels": levels, "rounds": a.rounds,
                    "max_tokens": a.max_tokens, "hog": "one busy-loop process pinned to the last CPU",
                    "skipped": skipped, "systems": {}}
    with tempfile.TemporaryDirectory() as logs:
        for name, spec in specs.items():
            with Running(spec, Path(logs), 600.0) as srv:
                def wave(c: int, spec=spec, srv=srv, name=name) -> float:
                    shots = asyncio.run(load.wave(spec.url, srv.model, spec.api_key, prompts.take(32, c),
                                                  a.max_tokens, 600.0, spec.extra_body))
                    bad = load.check(shots, a.max_tokens)
                    rate = load.decode_tok_s(shots)
                    if bad or rate is None:
                        raise RuntimeError(f"{name}: {bad[:3] or 'no decode rate (too few tokens?)'}")
                    return rate
                wave(1)   # warm-up
                per: dict = {}
                for c in levels:
                    alone, hogged = [], []
                    for _ in range(a.rounds):
                        alone.append(wave(c))
                        with Hog():
                            hogged.append(wave(c))
                    m_alone, m_hog = statistics.median(alone), statistics.median(hogged)
                    per[str(c)] = {"alone_tok_s": m_alone, "hogged_tok_s": m_hog, "hogged_over_alone": m_hog / m_alone,
                                   "alone_runs": alone, "hogged_runs": hogged}
                    print(f"  {name:10s} c={c:<3d} alone {m_alone:7.1f} tok/s, beside the hog {m_hog:7.1f} "
                          f"({m_hog / m_alone:.2f}x)", flush=True)
                result["systems"][name] = {"levels": per, "command": " ".join(spec.cmd)}
    if "llamacpp" in result["systems"]:
        e, lc = result["systems"]["edgeinfer"]["levels"], result["systems"]["llamacpp"]["levels"]
        result["edgeinfer_over_llamacpp_hogged"] = {c: e[c]["hogged_tok_s"] / lc[c]["hogged_tok_s"] for c in e}
        result["edgeinfer_over_llamacpp_alone"] = {c: e[c]["alone_tok_s"] / lc[c]["alone_tok_s"] for c in e}
        print(f"  edgeinfer / llama.cpp beside the hog: {result['edgeinfer_over_llamacpp_hogged']}")
    result.update(run_stamp(t0, load0))
    write_result(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
