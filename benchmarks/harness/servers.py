"""The servers bench_peers compares: how each is started, made ready, measured for memory and stopped.

Every server runs in its own session (start_new_session), so its whole process tree is found by session id
(/proc/<pid>/stat), its peak RSS is the sum over that tree, and stopping it kills the session's process group
by pid: SIGTERM, then SIGKILL after a grace period. Loopback only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ServerSpec:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    ready_path: str
    api_key: str | None = None
    notes: dict = field(default_factory=dict)
    text_prompts: bool = False                  # the server takes no token-id prompts: send the decoded text
    extra_body: dict = field(default_factory=dict)
    cwd: Path | None = None   # where it starts: `python -m` imports the cwd's packages before PYTHONPATH's

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_of(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[3])


def session_pids(sid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _session_of(p) == sid]


def _parent_of(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def tree_pids(root: int) -> list[int]:
    """root's session and every descendant of root: `edgeinfer serve` starts its backend and valkey in sessions
    of their own (ops/children.py), which a session-only count missed."""
    parents = {int(p): _parent_of(p) for p in os.listdir("/proc") if p.isdigit()}
    found = set(session_pids(root)) | {root}
    grew = True
    while grew:
        new = {p for p, pp in parents.items() if pp in found and p not in found}
        found |= new
        grew = bool(new)
    return sorted(p for p in found if p in parents)


def status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssWatch(threading.Thread):
    """Samples the process tree: the peak of the summed VmRSS, each process's sampled VmRSS peak and its VmHWM
    (its own peak as the kernel counts it)."""

    def __init__(self, sid: int, every_s: float = 0.25) -> None:
        super().__init__(daemon=True, name=f"rss-{sid}")
        self.sid, self.every_s = sid, every_s
        self.peak_sum_kib = 0
        self.peak_kib: dict[int, int] = {}
        self.hwm_kib: dict[int, int] = {}
        self._stop_evt = threading.Event()

    def sample(self) -> None:
        total = 0
        for pid in tree_pids(self.sid):
            rss = status_kib(pid, "VmRSS")
            total += rss
            self.peak_kib[pid] = max(self.peak_kib.get(pid, 0), rss)
            self.hwm_kib[pid] = max(self.hwm_kib.get(pid, 0), status_kib(pid, "VmHWM"))
        self.peak_sum_kib = max(self.peak_sum_kib, total)

    def run(self) -> None:
        while not self._stop_evt.wait(self.every_s):
            self.sample()

    def finish(self) -> dict:
        self._stop_evt.set()
        self.join(timeout=5)
        self.sample()
        return {"peak_rss_mib": round(self.peak_sum_kib / 1024, 1),
                "sum_vmhwm_mib": round(sum(self.hwm_kib.values()) / 1024, 1), "processes": len(self.hwm_kib)}


def http_json(url: str, headers: dict | None = None, timeout: float = 5.0) -> dict:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Running:
    """A started server: `with Running(spec, log_dir, timeout) as srv:` waits until it is ready, stops it on exit."""

    def __init__(self, spec: ServerSpec, log_dir: Path, ready_timeout_s: float) -> None:
        self.spec, self.log_dir, self.ready_timeout_s = spec, log_dir, ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.rss: RssWatch | None = None
        self.startup_s = 0.0
        self.model = ""
        self.memory: dict = {}
        self.log_path = log_dir / f"{spec.name}-{spec.port}.log"

    def __enter__(self) -> Running:
        t0 = time.monotonic()
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.spec.cmd, cwd=self.spec.cwd or ROOT, env=self.spec.env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.rss = RssWatch(self.proc.pid)
        self.rss.start()
        try:
            self._wait_ready()
            headers = {"authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
            self.model = http_json(self.spec.url + "/v1/models", headers)["data"][0]["id"]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        try:
            wait_http(self.spec.url + self.spec.ready_path, self.proc, self.ready_timeout_s, every_s=0.5,
                      request_timeout_s=2.0)
        except RuntimeError:
            raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} before it was ready; "
                               f"log: {self.log_path}\n{self.log_tail()}") from None
        except TimeoutError:
            raise TimeoutError(f"{self.spec.name} not ready after {self.ready_timeout_s:.0f}s; log: {self.log_path}\n"
                               f"{self.log_tail()}") from None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        if self.rss is not None:
            self.memory = self.rss.finish()
            self.rss = None
        p = self.proc
        if p is None:
            return
        for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if p.poll() is not None and not session_pids(p.pid):
                    break
                time.sleep(0.2)
            else:
                continue
            break
        p.wait(timeout=5)
        self.proc = None


def find_binary(name: str, *roots: Path) -> Path | None:
    for root in roots:
        if not root.exists():
            continue
        for p in sorted(root.rglob(name)):
            if p.is_file() and os.access(p, os.X_OK):
                return p
    return None


def edgeinfer_spec(threads: int, model_dir: Path | None = None, home: Path | None = None) -> ServerSpec:
    """What `edgeinfer serve` serves by default (gateway + one backend, built-in config and demo key), on the
    default model or `--model model_dir`; `home` as its EDGEINFER_HOME (a fresh one: an empty page store)."""
    import sys

    from edgeinfer.gateway.config import DEMO_API_KEY

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    if home is not None:
        env["EDGEINFER_HOME"] = str(home)
    model = ["--model", str(model_dir)] if model_dir is not None else []
    return ServerSpec("edgeinfer", [sys.executable, "-m", "edgeinfer.ops.cli", "serve", "--port", str(port), *model],
                      env, port, "/ready", DEMO_API_KEY, {"command": "edgeinfer serve " + (" ".join(model) or
                                                                                          "(defaults)")})


def llamacpp_spec(threads: int, gguf: Path, build_dir: Path, venv: Path, slots: int, ctx_per_slot: int) -> ServerSpec:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    server = find_binary("llama-server", build_dir, venv / "bin")
    if server is not None:
        lib_dirs = sorted({str(p.parent) for p in build_dir.rglob("libllama.so*")}) if build_dir.exists() else []
        env["LD_LIBRARY_PATH"] = ":".join([*lib_dirs, env.get("LD_LIBRARY_PATH", "")])
        cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", str(slots), "-cb", "-c", str(slots * ctx_per_slot), "--no-webui"]
        return ServerSpec("llamacpp", cmd, env, port, "/health", None, {"server": str(server)})
    cmd = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--n_ctx", str(ctx_per_slot), "--interrupt_requests", "False"]
    return ServerSpec("llamacpp", cmd, env, port, "/v1/models", None,
                      {"server": "llama_cpp.server (no llama-server binary found: one request at a time)"},
                      text_prompts=True, extra_body={"logit_bias": {"2": -100.0}})   # no ignore_eos: ban EOS (id 2)


def vllm_spec(threads: int, model_dir: Path, venv: Path, dtype: str, max_seqs: int, max_len: int,
              kv_gib: int, eager: bool = False) -> ServerSpec:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", model_dir.name, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs), *(["--enforce-eager"] if eager else [])]
    return ServerSpec("vllm", cmd, env, port, "/health", None,
                      {"dtype": dtype, "kv_cache_gib": kv_gib, "enforce_eager": eager})


class ProcessGroup:
    """Processes a benchmark starts (each in its own session, its output in log_dir/<name>.log) and stops together:
    SIGTERM to each process group, newest first, then SIGKILL after 20 s."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p))
        return p

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 60.0, every_s: float = 0.1,
              request_timeout_s: float = 1.0) -> None:
    """Until GET url answers 200, asking every `every_s`; raises RuntimeError if proc exits first, TimeoutError
    after timeout_s. Every way a benchmark waits for a server it started."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=request_timeout_s) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(every_s)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")
