"""A real `python -m backend.server` process on a free loopback port, for tests that need whole nodes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.support.redis_server import free_port

INTERNAL_SECRET = "edgeinfer-test-internal-secret"     # what the gateway sends on /internal/*
INTERNAL_AUTH = {"authorization": f"Bearer {INTERNAL_SECRET}"}


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in Prometheus text whose labels include `labels` (0.0 when there is none)."""
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


class BackendProcess:
    def __init__(self, model_dir, node_id: str, args: list[str], seed: str, log_path: Path | None = None) -> None:
        self.node_id = node_id
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "edgeinfer.backend.server", "--model", str(model_dir), "--port", str(self.port),
               "--node-id", node_id, "--log-level", "WARNING", *args]
        self._log = open(log_path, "wb") if log_path is not None else None
        self.proc = subprocess.Popen(cmd, env={**os.environ, "EDGEINFER_CACHE_SEED": seed,
                                                      "EDGEINFER_INTERNAL_SECRET": INTERNAL_SECRET},
                                     stdout=subprocess.DEVNULL, stderr=self._log)

    def _exit_detail(self) -> str:
        if self.log_path is not None and self.log_path.exists():
            return self.log_path.read_text()[-2000:]
        return f"exit code {self.proc.returncode}"

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"backend {self.node_id} exited: {self._exit_detail()}"
            try:
                if requests.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"backend {self.node_id} not ready after {timeout_s}s")

    def generate(self, prompt: list[int], namespace: str, max_tokens: int = 8, **extra) -> tuple[list[int], object]:
        """A greedy request (EOS ignored) on /internal/generate: (every token id, the last StreamChunk). `extra`: more
        GenerateRequest fields (prefill_only, kv_source, ...)."""
        from edgeinfer.protocol.wire import chunk_decoder

        body = {"request_id": f"{self.node_id}-{time.monotonic_ns()}", "prompt_token_ids": prompt,
                "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
                "cache_namespace": namespace, **extra}
        ids: list[int] = []
        last = None
        with requests.post(self.url + "/internal/generate", json=body, headers=INTERNAL_AUTH, stream=True,
                           timeout=120) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line:
                    last = chunk_decoder.decode(line)
                    ids += last.token_ids
        assert last is not None, "the stream ended without a chunk"
        return ids, last

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0.0 when there is none)."""
        return metric_sum(requests.get(self.url + "/metrics", timeout=5).text, name, **labels)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
