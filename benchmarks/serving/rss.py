"""Peak RSS of `edgeinfer serve` per process, under a bounded load (issue 15: peak RSS <= 1.5x llama.cpp's).

Starts `edgeinfer serve` exactly as bench_peers does (benchmarks/peer_servers.edgeinfer_spec: every default,
its own session), sends bench_peers' warm-up wave, then a decode wave and a prefill wave of --clients
streaming /v1/completions, and reports for every process of the session: its role, VmHWM (its own peak),
the peak of its sampled VmRSS, and /proc/PID/smaps_rollup at the end of the load (anonymous vs file-backed).
The tree's peak is the peak of the summed VmRSS, as bench_peers measures it.

    python -m benchmarks serving.rss [--clients 8] [--threads 2] [--serve-arg=--backend-arg=...]

Writes benchmarks/results/serving.rss.json (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load  # noqa: E402
from benchmarks.harness.servers import RssWatch, Running, edgeinfer_spec, status_kib, tree_pids  # noqa: E402
from benchmarks.peers import Prompts, prompt_tokens, tokenizer  # noqa: E402

ROLLUP_KEYS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Anonymous", "Shared_Clean", "Private_Clean", "Private_Dirty")


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def role(cmd: list[str]) -> str:
    text = " ".join(cmd)
    if "edgeinfer.backend.server" in text:
        return "backend"
    if "edgeinfer.ops.cli serve" in text or "edgeinfer serve" in text:
        return "gateway (edgeinfer serve)"
    if "valkey" in text or "redis-server" in text:
        return "valkey"
    if "multiprocessing" in text or "spawn_main" in text or "forkserver" in text:
        return "tokenizer worker"
    return text[:80] or "?"


def smaps_rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ROLLUP_KEYS:
                out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


class PerProcess(RssWatch):
    """The harness's tree sampler (every 0.25 s: each process's VmRSS peak and VmHWM, the summed peak over the tree:
    `edgeinfer serve`, its backend and valkey, which run in sessions of their own), started when the server is
    idle rather than at its start, plus each process's command line."""

    def __init__(self, root: int) -> None:
        super().__init__(root)
        self.cmd: dict[int, list[str]] = {}

    def sample(self) -> None:
        super().sample()
        for pid in self.peak_kib:
            if pid not in self.cmd:
                self.cmd[pid] = cmdline(pid)


def mib(kib: int) -> float:
    return round(kib / 1024, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", type=int, default=8, help="concurrent requests per wave")
    p.add_argument("--levels", default="", help="bench_peers' whole load instead: a decode wave and a prefill wave "
                                                "at each of these concurrencies (e.g. 1,8,32), in order")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for `edgeinfer serve`")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the served processes")
    p.add_argument("--label", default="default")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving.rss.json")
    a = p.parse_args(argv)

    spec = edgeinfer_spec(a.threads)
    spec.cmd.extend(a.serve_arg)
    spec.env.update(kv.split("=", 1) for kv in a.env)
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model

    tok = tokenizer(ensure_native_default_model())
    prompts = Prompts(prompt_tokens(tok))
    with tempfile.TemporaryDirectory() as logs, Running(spec, Path(logs), 600.0) as srv:
        assert srv.proc is not None
        watch = PerProcess(srv.proc.pid)
        watch.sample()
        idle = {pid: status_kib(pid, "VmRSS") for pid in tree_pids(srv.proc.pid)}
        watch.start()

        def wave(ps: list[list[int]], n: int) -> list[load.Shot]:
            return asyncio.run(load.wave(spec.url, srv.model, spec.api_key, ps, n, 600.0))

        t0 = time.monotonic()
        shots = wave(prompts.take(16, 32), 4)                        # bench_peers' warm-up wave
        for c in [int(x) for x in a.levels.split(",") if x] or [a.clients]:
            shots += wave(prompts.take(32, c), a.max_tokens)
            shots += wave(prompts.take(a.prefill_len, c), 1)
        took = time.monotonic() - t0
        watch.sample()
        rollups = {pid: smaps_rollup(pid) for pid in tree_pids(srv.proc.pid)}
        watch.finish()
        errors = [s.error for s in shots if s.error]
        procs = []
        for pid in sorted(watch.peak_kib):
            procs.append({"pid": pid, "role": role(watch.cmd.get(pid, [])), "cmd": " ".join(watch.cmd.get(pid, []))[:300],
                          "idle_rss_mib": mib(idle.get(pid, 0)), "peak_rss_mib": mib(watch.peak_kib[pid]),
                          "vmhwm_mib": mib(watch.hwm_kib[pid]),
                          "after_load_kib": rollups.get(pid, {})})
    result = {"label": a.label, "command": " ".join(spec.cmd), "env": a.env, "clients": a.clients,
              "levels": a.levels or None,
              "max_tokens": a.max_tokens, "prefill_len": a.prefill_len, "load_s": round(took, 1),
              "requests": len(shots), "errors": errors[:5], "error_count": len(errors),
              "peak_tree_rss_mib": mib(watch.peak_sum_kib),
              "sum_vmhwm_mib": mib(sum(watch.hwm_kib.values())), "processes": procs}
    out = json.dumps(result, indent=2)
    print(out)
    prior = []
    if a.out.exists():
        try:
            prior = json.loads(a.out.read_text())
            prior = prior if isinstance(prior, list) else [prior]
        except ValueError:
            prior = []
    a.out.write_text(json.dumps([r for r in prior if r.get("label") != a.label] + [result], indent=2) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
