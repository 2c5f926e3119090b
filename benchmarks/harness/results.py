"""What every benchmark records about its run and how it writes its JSON result (one place for both)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_stamp(t0: float, load0: tuple[float, float, float]) -> dict:
    """Load averages at the start (load0, from os.getloadavg()) and now, wall seconds since t0
    (time.monotonic()), and the command line relative to the repository root."""
    return {"loadavg_1_5_15_at_start": [round(x, 2) for x in load0],
            "loadavg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(time.monotonic() - t0, 1),
            "command": command_line()}


def command_line() -> str:
    """How this process was started, as a user would type it from the checkout's root: a benchmark module
    started with `python -m benchmarks.x.y` (what `python -m benchmarks` does) reads `python -m benchmarks.x.y`."""
    argv0 = Path(sys.argv[0]).resolve()
    try:
        rel = argv0.relative_to(ROOT)
    except ValueError:
        return " ".join(sys.argv)
    if rel.parts and rel.parts[0] == "benchmarks" and rel.suffix == ".py":
        return " ".join(["python -m", ".".join(rel.with_suffix("").parts), *sys.argv[1:]])
    return " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])


def write_result(result: dict, out: str | Path, echo: bool = True) -> Path:
    """result as indented JSON at out (parents created); printed too unless echo is False."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    path.write_text(text + "\n")
    if echo:
        print(text)
    return path


def interleaved(sides: list, rounds: int):
    """(round, side) for every side in every round, the order reversed on odd rounds, so that a shared box's
    drift within a round lands on both ends alike: how every side-by-side benchmark here orders its runs."""
    for rnd in range(rounds):
        for side in (sides if rnd % 2 == 0 else sides[::-1]):
            yield rnd, side


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank on the sorted values, q in 0..100); None for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def latency_summary(xs: list[float]) -> dict:
    """Seconds -> {n, p50, p90, p99 in ms}."""
    out: dict = {"n": len(xs)}
    for q in (50, 90, 99):
        v = percentile(xs, q)
        out[f"p{q}"] = None if v is None else round(v * 1000, 1)
    return out | {"unit": "ms"}
