"""Every benchmark suite runs end to end in its --smoke mode (tiny settings, no peers), through the one entry point
`python -m benchmarks`, so none of them rots; every part's result is written and its headline numbers read back;
the recorded results in benchmarks/results/ still read; no benchmark module is left outside a suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.suites import BY_NAME, PARTS, SUITES

ROOT = Path(__file__).resolve().parents[2]
# recorded results that do not exist yet: the GPU kernel benchmark has not run on a GPU
NOT_RECORDED = {"kernels.gpu"}


def _run(args: list[str], timeout: float, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGEINFER_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# smoke runs at once: one. Two at a time saved ~35 s of ~6 minutes (the runs are CPU-bound on 2 cores), and in one
# clean-clone run the speculative suite got an HTTP 404 from a server while the cache and fairness suites ran beside
# it (their servers pick free ports independently: a port taken twice is the likely cause); not worth the risk
SMOKE_AT_ONCE = 1


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Every suite's smoke run, started one after another in the background as soon as the first smoke test asks;
    each test waits for its own. One EDGEINFER_HOME: the built-in model is imported once, before any run starts
    (runs at once must not race on the import)."""
    home = tmp_path_factory.mktemp("bench-home")
    warm = subprocess.run([sys.executable, "-c", "from edgeinfer.backend.model.gguf_import import "
                           "ensure_default_model, ensure_native_default_model; ensure_default_model(); "
                           "ensure_native_default_model()"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), EDGEINFER_HOME=str(home)))
    assert warm.returncode == 0, warm.stderr[-3000:]
    root = tmp_path_factory.mktemp("bench-out")

    def run(suite: str) -> tuple[subprocess.CompletedProcess, Path]:
        s, out = BY_NAME[suite], root / suite
        return _run([suite, "--smoke", "--out-dir", str(out)], sum(p.smoke_timeout_s for p in s.parts) + 60,
                    home), out

    pool = ThreadPoolExecutor(SMOKE_AT_ONCE)
    futures = {s.name: pool.submit(run, s.name) for s in SUITES}
    yield home, futures
    for f in futures.values():
        f.cancel()
    pool.shutdown(wait=True)


@pytest.mark.slow
@pytest.mark.parametrize("suite", [s.name for s in SUITES])
def test_every_suite_runs_in_smoke_mode(suite, tmp_path, smoke_runs):
    home, futures = smoke_runs
    s = BY_NAME[suite]
    r, out = futures[suite].result()
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    for p in s.parts:
        result = out / f"{p.module}.json"
        assert result.is_file(), f"{p.module} wrote no {result.name}: {r.stdout[-2000:]}"
        json.loads(result.read_text())
    summary = (out / f"{suite}.summary.md").read_text()
    assert summary.startswith(f"# {suite}: ")
    assert "(no result)" not in summary and "(unreadable result)" not in summary, summary
    if suite == "fairness":   # the medians over runs read what a run writes
        med = tmp_path / "medians.json"
        r = _run(["fairness.tenants", "--summarize", str(out / "fairness.tenants.json"), "--out", str(med)], 60,
                 home)
        assert r.returncode == 0, r.stderr[-2000:]
        medians = json.loads(med.read_text())["medians"]
        assert medians and all(m["runs"] == 1 and m["p99_ratio"] is not None for m in medians.values()), medians


@pytest.mark.parametrize("part", sorted(set(PARTS) - NOT_RECORDED))
def test_every_recorded_result_still_reads(part):
    p = PARTS[part]
    assert p.result.is_file(), f"no recorded result {p.result}"
    rows = p.headline(json.loads(p.result.read_text()))
    assert rows, f"{part}: no headline numbers from {p.result.name}"
    assert any(v is not None for _, v in rows), rows


def test_every_benchmark_module_belongs_to_a_suite():
    mods = {".".join(f.relative_to(ROOT / "benchmarks").with_suffix("").parts)
            for f in (ROOT / "benchmarks").rglob("*.py")}
    helpers = {m for m in mods if m.startswith("harness.") or m.endswith("__init__") or m in ("suites", "__main__")}
    assert mods - helpers == set(PARTS), (sorted(mods - helpers - set(PARTS)), sorted(set(PARTS) - mods))


def test_the_entry_point_lists_suites_and_refuses_unknown_names(tmp_path):
    r = _run([], 60, tmp_path)
    assert r.returncode == 0
    for s in SUITES:
        assert f"\n{s.name} " in r.stdout
    r = _run(["nonesuch"], 60, tmp_path)
    assert r.returncode == 2 and "unknown suite or part 'nonesuch'" in r.stderr
    r = _run(["serving", "--rate", "5"], 60, tmp_path)
    assert r.returncode == 2 and "pass a part's own arguments by naming the part" in r.stderr
    r = _run(["table"], 60, tmp_path)
    assert r.returncode == 0 and all(f"| {s.name} |" in r.stdout for s in SUITES)


def test_a_one_part_suite_passes_its_parts_arguments_and_out_through(tmp_path):
    recorded = ROOT / "benchmarks" / "results" / "sizing.json"
    before = recorded.read_bytes()
    out = tmp_path / "elsewhere" / "k2.json"
    r = _run(["sizing", "--gpus", "4", "--out", str(out)], 120, tmp_path / "home")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["node"]["gpus"] == 4
    assert recorded.read_bytes() == before          # the recorded result is not overwritten
    assert (out.parent / "sizing.summary.md").read_text().startswith("# sizing: ")


def test_a_one_part_suites_help_writes_nothing(tmp_path):
    """`python -m benchmarks peers --help` prints the part's help and writes no summary or result (issue 41)."""
    results = ROOT / "benchmarks" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.iterdir()}
    r = _run(["peers", "--help"], 120, tmp_path)
    assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr[-500:]
    after = {p: p.stat().st_mtime_ns for p in results.iterdir()}
    assert after == before, sorted(set(after.items()) ^ set(before.items()))
