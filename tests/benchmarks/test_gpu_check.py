"""benchmarks/gpu_check.sh without a GPU: it parses, it stops before spending device time when a prerequisite is
missing (here: CUDA) and still writes its summary, a hung step costs only its own timeout, and the kernel
benchmark's dry run writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, OUT=str(tmp_path / "out"), EDGEINFER_HOME=str(tmp_path / "home"),
               PYTHONPATH=str(ROOT), PYTHON=sys.executable, **extra)
    return env


def test_script_parses_and_rejects_unknown_flags(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    r = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True, env=_env(tmp_path))
    assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_it_skips_every_gpu_step_and_says_why(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=_env(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["mode"] == "aborted" and summary["ok"] is False
    steps = {s["step"]: s for s in summary["steps"]}
    assert steps["prereqs"]["status"] == "failed"
    gpu_steps = ["model", "kernel_tests", "bench_kernels", "bench_engine", "parity", "batch16", "cuda_path",
                 "bench_int4", "tp"]
    assert all(steps[s]["status"] == "skipped" and "prerequisites" in steps[s]["note"] for s in gpu_steps)
    prereqs = json.loads((out / "prereqs.json").read_text())
    assert prereqs["items"]["cuda_device"]["ok"] is False and "fix" in prereqs["items"]["cuda_device"]
    assert "MISSING" in (out / "gpu_check.log").read_text()


def test_a_hung_step_costs_its_timeout_not_the_run(tmp_path):
    """The step runner from the script, driven with a command that never ends and a 2 s budget."""
    text = SCRIPT.read_text()
    runner = text[text.index("say() {"):text.index("skip_step() {")]
    prog = f"""set -u -o pipefail
PY={sys.executable}; LOG={tmp_path}/log; STEPS={tmp_path}/steps; STEPLOG={tmp_path}/steplog
: > $LOG; : > $STEPS; BUDGET=60; DEADLINE=$(( $(date +%s) + 60 )); MIN_STEP=1
{runner}
run_step hang 2 sleep 30
run_step quick 10 true
"""
    r = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    steps = [json.loads(line) for line in (tmp_path / "steps").read_text().splitlines()]
    assert [(s["step"], s["status"]) for s in steps] == [("hang", "timeout"), ("quick", "ok")]
    assert steps[0]["rc"] == 124 and steps[0]["seconds"] <= 5


def test_bench_kernels_dry_run_writes_rows_for_every_shape(tmp_path):
    out = tmp_path / "bk.json"
    env = _env(tmp_path, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels.gpu", "--cpu-dry-run", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert [row["M"] for row in report["w4a16_gemm"]] == [1, 16]
    assert all(row["rel_err_vs_dequant"] < 3e-2 for row in report["w4a16_gemm"])
    assert {(row["batch"], row["context"]) for row in report["paged_decode"]} == {(1, 64), (1, 200), (3, 64), (3, 200)}
    assert all(row["fp8_max_err"] < 0.02 and row["bf16_max_err"] < 0.02 for row in report["paged_decode"])
    assert set(report["goals"]) >= {"w4a16_min_speedup_m_le_16", "fp8_min_speedup_8k"}
