"""The gateway (and `edgeinfer gateway`) runs without torch and without the backend package: its contracts
with the backends live in the torch-free `protocol/` package."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "backend", "kernels")


def _heavy(modules) -> list[str]:
    return sorted(m for m in modules if m.removeprefix("edgeinfer.").split(".")[0] in HEAVY)


def test_building_the_gateway_app_imports_neither_torch_nor_backend(tokenizer_dir):
    code = f"""
import json, sys
import edgeinfer.gateway.cli, edgeinfer.gateway.tokenpool, edgeinfer.ops.cli, edgeinfer.ops.commands, edgeinfer.ops.node_client
from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.app import create_app
cfg = config_mod.parse({{"models": [{{"name": "m", "tokenizer": {str(tokenizer_dir)!r}}}],
                        "nodes": [{{"id": "n0", "url": "http://127.0.0.1:9", "model": "m"}}]}})
create_app(cfg)
print(json.dumps(sorted(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "edgeinfer.gateway.app" in modules and "edgeinfer.protocol.wire" in modules
    assert _heavy(modules) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_edgeinfer_gateway_process_never_imports_torch_or_backend(tokenizer_dir, tmp_path):
    """The real CLI path (`python -m ops.cli gateway`), serving until /health answers; `-X importtime` lists
    every module the process imported."""
    port = _free_port()
    log = tmp_path / "gateway.err"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "edgeinfer.ops.cli", "gateway", "--port", str(port),
                                 "--model", f"m={tokenizer_dir}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()[-2000:]
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "gateway did not answer /health within 60 s"
                time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    imported = [line.rsplit("|", 1)[1].strip() for line in log.read_text().splitlines()
                if line.startswith("import time:") and line.count("|") == 2]
    assert "edgeinfer.gateway.app" in imported and "edgeinfer.protocol.wire" in imported
    assert _heavy(imported) == []
