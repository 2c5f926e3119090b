"""One entry point for the benchmark suites (run from the checkout's root):

  python -m benchmarks                          the suites, their parts and the question each answers
  python -m benchmarks SUITE [--smoke] [--out-dir DIR]
                                                every part of SUITE, each in its own process; writes
                                                DIR/<part>.json (default benchmarks/results) and DIR/<suite>.summary.md
  python -m benchmarks PART [ARGS...]           one part with its own arguments (e.g. `engine.step --baseline-tree
                                                /tmp/base`); `PART --help` lists them; a one-part suite takes its
                                                part's arguments too (`peers --rounds 3`)
  python -m benchmarks table                    the README's "Measured" table from the recorded results

--smoke runs each part with tiny settings (seconds, no peers needed) into a temporary directory unless --out-dir
is given: tests/benchmarks/test_suites.py runs every suite that way so none of them rots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suites import BY_NAME, PARTS, ROOT, SUITES, Part, Suite


def listing() -> str:
    lines = []
    for s in SUITES:
        lines.append(f"{s.name:13s} {s.question}")
        for p in s.parts:
            lines.append(f"  {p.module:28s} {p.question}")
    return "\n".join(lines)


def headline_rows(part: Part, result_path: Path) -> list[tuple[str, object]]:
    if not result_path.is_file():
        return [("(no result)", str(result_path))]
    try:
        return part.headline(json.loads(result_path.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        return [("(unreadable result)", f"{type(e).__name__}: {e}")]


def summary_md(suite: Suite, results: dict[str, Path]) -> str:
    lines = [f"# {suite.name}: {suite.question}", "", "| part | number | value |", "|---|---|---|"]
    for p in suite.parts:
        for label, value in headline_rows(p, results[p.module]) or [("-", "-")]:
            lines.append(f"| {p.module} | {label} | {value} |")
    return "\n".join(lines) + "\n"


def table() -> str:
    lines = ["| suite | command | headline (recorded in benchmarks/results/) |", "|---|---|---|"]
    for s in SUITES:
        heads = []
        for p in s.parts:
            rows = [f"{label}: {value}" for label, value in headline_rows(p, p.result)[:4]
                    if value is not None and not label.startswith("(")]
            if rows:
                heads.append("; ".join(rows))
        lines.append(f"| {s.name} | `python -m benchmarks {s.name}` | {' / '.join(heads) or 'see the JSON'} |")
    return "\n".join(lines) + "\n"


def run_part(part: Part, args: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> int:
    cmd = [sys.executable, "-m", f"benchmarks.{part.module}", *args]
    print(f"== {part.module}: {' '.join(cmd[1:])}", flush=True)
    t = time.monotonic()
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), full_env.get("PYTHONPATH", "")) if x)
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=full_env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"!! {part.module} ran past {timeout:.0f} s", flush=True)
        rc = 124
    print(f"== {part.module}: rc {rc} in {time.monotonic() - t:.1f} s", flush=True)
    return rc


def run_suite(suite: Suite, smoke: bool, out_dir: Path | None, extra: list[str] | None = None) -> int:
    if out_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix=f"bench-{suite.name}-")) if smoke else ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    results: dict[str, Path] = {}
    for p in suite.parts:
        smoke_args = [x.replace("{out_dir}", str(out_dir)) for x in p.smoke] if smoke else []
        args = [*smoke_args, *(extra or [])]
        given = [args[i + 1] for i, x in enumerate(args[:-1]) if x == "--out"]
        given += [x.split("=", 1)[1] for x in args if x.startswith("--out=")]
        results[p.module] = Path(given[-1]) if given else out_dir / f"{p.module}.json"
        if not given:
            args += ["--out", str(results[p.module])]
        rc = run_part(p, args, p.smoke_env if smoke else None, p.smoke_timeout_s if smoke else None)
        if rc != 0:
            failed.append(f"{p.module} (rc {rc})")
    md = summary_md(suite, results)
    # beside the results: the run's directory, or where a one-part suite's --out put its result
    (results[suite.parts[-1].module].parent / f"{suite.name}.summary.md").write_text(md)
    print(md)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__.strip() + "\n\n" + listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "table":
        print(table(), end="")
        return 0
    if name in BY_NAME:
        smoke = "--smoke" in rest
        out_dir = None
        if "--out-dir" in rest:
            i = rest.index("--out-dir")
            if i + 1 >= len(rest):
                print("--out-dir needs a directory", file=sys.stderr)
                return 2
            out_dir = Path(rest[i + 1])
            rest = rest[:i] + rest[i + 2:]
        unknown = [a for a in rest if a != "--smoke"]
        if len(BY_NAME[name].parts) == 1 and ("-h" in unknown or "--help" in unknown):
            return run_part(BY_NAME[name].parts[0], unknown)     # its help only: no --out, no summary written
        if unknown and len(BY_NAME[name].parts) == 1:
            return run_suite(BY_NAME[name], smoke, out_dir, unknown)
        if unknown:
            print(f"unknown arguments for suite {name!r}: {unknown}; pass a part's own arguments by naming the part "
                  f"({', '.join(p.module for p in BY_NAME[name].parts)})", file=sys.stderr)
            return 2
        return run_suite(BY_NAME[name], smoke, out_dir)
    if name in PARTS:
        return run_part(PARTS[name], rest)
    print(f"unknown suite or part {name!r}; expected one of: {', '.join(BY_NAME)} or a part "
          f"({', '.join(PARTS)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
