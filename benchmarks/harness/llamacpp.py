"""llama.cpp's own benchmark tools (llama-bench, llama-batched-bench): run them and parse what they print."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path


def _row_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_batched_bench(text: str) -> list[dict]:
    """Rows of llama-batched-bench's markdown table, e.g. `|  128 |  64 |  8 | ... | S_TG t/s | ...`, as
    {pp, tg, batch, n_kv, t_pp_s, prefill_tok_s, t_tg_s, decode_tok_s, t_s, total_tok_s}."""
    names = {"PP": "pp", "TG": "tg", "B": "batch", "N_KV": "n_kv", "T_PP s": "t_pp_s", "S_PP t/s": "prefill_tok_s",
             "T_TG s": "t_tg_s", "S_TG t/s": "decode_tok_s", "T s": "t_s", "S t/s": "total_tok_s"}
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = _row_cells(line)
        if "PP" in cells and "TG" in cells:
            header = [names.get(c, c) for c in cells]
        elif header and len(cells) == len(header) and not set(cells[0]) <= {"-", ":"}:
            row = {}
            for k, v in zip(header, cells):
                row[k] = int(v) if k in ("pp", "tg", "batch", "n_kv") else float(v)
            rows.append(row)
    if not rows:
        raise ValueError(f"no llama-batched-bench table rows in output:\n{text[-2000:]}")
    return rows


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench `-o json` output (a JSON array): one row per test, pp (n_prompt) or tg (n_gen)."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"no JSON array in llama-bench output:\n{text[-2000:]}")
    rows = []
    for r in json.loads(text[start:]):
        test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        rows.append({"test": test, "n_prompt": r.get("n_prompt", 0), "n_gen": r.get("n_gen", 0),
                     "tok_s": r["avg_ts"], "stddev_tok_s": r.get("stddev_ts"), "threads": r.get("n_threads"),
                     "type_k": r.get("type_k"), "build_commit": r.get("build_commit"),
                     "model_type": r.get("model_type")})
    return rows


def _run(cmd: list[str], env: dict, timeout_s: float) -> tuple[str, float]:
    t = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout, time.monotonic() - t


def _env(binary: Path, build_dir: Path) -> dict:
    libs = sorted({str(p.parent) for p in build_dir.rglob("libllama.so*")}) if build_dir.exists() else []
    return {**os.environ, "LD_LIBRARY_PATH": ":".join([*libs, str(binary.parent), os.environ.get("LD_LIBRARY_PATH", "")])}


def llama_bench(binary: Path, build_dir: Path, gguf: Path, threads: int, prompt: int, gen: int, reps: int,
                timeout_s: float) -> dict:
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-t", str(threads), "-r", str(reps),
           "-o", "json"]
    out, secs = _run(cmd, _env(binary, build_dir), timeout_s)
    return {"command": " ".join(cmd), "seconds": round(secs, 1), "rows": parse_llama_bench(out)}


def batched_bench(binary: Path, build_dir: Path, gguf: Path, threads: int, npp: int, ntg: int, npl: list[int],
                  timeout_s: float) -> dict:
    ctx = max(npl) * (npp + ntg)
    cmd = [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(npp),
           "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), "-t", str(threads), "-tb", str(threads)]
    out, secs = _run(cmd, _env(binary, build_dir), timeout_s)
    return {"command": " ".join(cmd), "seconds": round(secs, 1), "rows": parse_batched_bench(out)}
