"""`edgeinfer serve` as a test (or a benchmark) starts it: the installed console script in its own process, its
output collected line by line, the demo tenant's chat request, its children by /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from edgeinfer.gateway.config import DEMO_API_KEY as DEMO_KEY
from tests.support.redis_server import free_port

EDGEINFER = Path(sys.executable).with_name("edgeinfer")   # the console script pip installed
QUESTION = [{"role": "system", "content": "You are a concise assistant. Answer in one short sentence, with the "
             "fact the user asks for and nothing else; no lists, no preamble."},
            {"role": "user", "content": "What is the capital of France?"}]


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


class Serve:
    """One `edgeinfer serve` process, its output collected line by line on a thread."""

    def __init__(self, home: Path, cwd: Path, *args: str, terminal_group: bool = False) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}
        env["EDGEINFER_HOME"] = str(home)
        self.env = env
        # terminal_group: its own process group, as a shell's foreground job (Ctrl-C: SIGINT to the whole group)
        self.proc = subprocess.Popen([str(EDGEINFER), "serve", "--port", str(self.port), *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=terminal_group)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            assert self.proc.poll() is None, "".join(self.lines)[-4000:]
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} in {timeout_s} s:\n" + "".join(self.lines)[-4000:])

    def ask(self) -> dict:
        r = requests.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", timeout=120,
                          headers={"authorization": f"Bearer {DEMO_KEY}"},
                          json={"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 16,
                                "messages": QUESTION})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
