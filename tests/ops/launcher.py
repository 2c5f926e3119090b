"""Test-side restart script that `ops rollout --command` calls: replace one backend process.

  python tests/ops/launcher.py --state DIR --model DIR --redis-url URL --node-id N --port P --version V
      [--break-node N --break-version V] [--heartbeat S] [--ready-timeout S] [--start-drained]

Stops the node's old process (pid in DIR/<node>.pid: SIGTERM, which drains gracefully, then SIGKILL
after 45 s), starts `python -m backend.server` on the same port with the new --version, and waits
until /health answers. With --break-node/--break-version that pair starts a process that exits at
once (a model dir that does not exist), so the script exits 1: a failed rollout gate.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")   # a zombie is dead (nobody may reap it)


def stop(pidfile: Path, grace_s: float = 45.0) -> None:
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text())
    if alive(pid):
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            while alive(pid):
                time.sleep(0.05)
    pidfile.unlink()


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--state", "--model", "--redis-url", "--node-id", "--port", "--version"):
        p.add_argument(name, required=True)
    p.add_argument("--break-node", default="")
    p.add_argument("--break-version", default="")
    p.add_argument("--heartbeat", default="0.5")
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--start-drained", action="store_true")
    a = p.parse_args()
    state = Path(a.state)
    pidfile = state / f"{a.node_id}.pid"
    stop(pidfile)
    broken = a.node_id == a.break_node and a.version == a.break_version
    model = str(state / "no-such-model") if broken else a.model
    cmd = [sys.executable, "-m", "edgeinfer.backend.server", "--model", model, "--port", a.port, "--node-id", a.node_id,
           "--redis-url", a.redis_url, "--operator-key", os.environ["EDGEINFER_OPERATOR_KEY"],
           "--version", a.version, "--num-pages", "256", "--max-num-seqs", "16", "--heartbeat", a.heartbeat,
           "--log-level", "WARNING"] + (["--start-drained"] if a.start_drained else [])
    with open(state / f"{a.node_id}.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log, start_new_session=True)
    pidfile.write_text(str(proc.pid))
    url = f"http://127.0.0.1:{a.port}"
    end = time.monotonic() + a.ready_timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            print(f"backend {a.node_id} {a.version} exited with {proc.returncode} before it was healthy",
                  file=sys.stderr)
            return 1
        if healthy(url):
            print(f"backend {a.node_id} {a.version} pid {proc.pid} healthy on {url}")
            return 0
        time.sleep(0.2)
    print(f"backend {a.node_id} {a.version} not healthy after {a.ready_timeout}s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
