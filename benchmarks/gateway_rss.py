"""Gateway process RSS: start `python -m ops.cli gateway` from a checkout, wait for /health, read VmRSS of the
process and of its children (the tokenizer pool), 3 runs.

  python benchmarks/gateway_rss.py CHECKOUT_DIR TOKENIZER_DIR
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def measure(root: str, tokenizer: str) -> tuple[int, int]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgeinfer.ops.cli", "gateway", "--port", str(port), "--model", f"m={tokenizer}"],
                            cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"gateway from {root} did not answer /health") from None
                time.sleep(0.2)
        time.sleep(2)
        return _rss_kib(proc.pid), sum(_rss_kib(c) for c in _children(proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


if __name__ == "__main__":
    root, tok = sys.argv[1], sys.argv[2]
    print(root, "VmRSS KiB (main, children) per run:", [measure(root, tok) for _ in range(3)])
