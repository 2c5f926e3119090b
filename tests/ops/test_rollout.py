"""Operations end to end on loopback: 3 real backend processes (SmolLM2-135M) registered in a real
valkey, a gateway process routing from the registry, and clients streaming through it the whole time.

- `ops rollout` across the 3 nodes: zero failed or truncated client streams, every node at the new version.
- a rollout whose new version fails on the second node: the touched nodes go back to the old version.
- the operator key: tenant keys and wrong keys never pass the admin endpoints; drain/undrain/status.
- SIGKILL mid-stream: the client gets an SSE error event and [DONE], routing moves within one heartbeat,
  the registry drops the node (TTL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from edgeinfer.gateway.config import hash_key
from tests.support.backend_process import INTERNAL_AUTH, INTERNAL_SECRET
from tests.support.redis_server import ValkeyServer, command, free_port

pytestmark = pytest.mark.slow

HEARTBEAT = 0.5
OPERATOR_KEY = "op-test-operator-key"
TENANT_KEY = "sk-ops-test-tenant"
ADMIN_KEY = "gw-ops-test-admin"
SEED = "ops-test-seed"
NODES = ("n0", "n1", "n2")
LAUNCHER = Path(__file__).with_name("launcher.py")
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return {**os.environ, "EDGEINFER_OPERATOR_KEY": OPERATOR_KEY, "EDGEINFER_CACHE_SEED": SEED,
            "EDGEINFER_INTERNAL_SECRET": INTERNAL_SECRET,
            "OMP_NUM_THREADS": "1", "EDGEINFER_LOG_LEVEL": "WARNING"}


class Cluster:
    def __init__(self, tmp: Path, model_dir: Path, redis: ValkeyServer) -> None:
        self.tmp = tmp
        self.model_dir = model_dir
        self.redis = redis
        self.ports = {n: free_port() for n in NODES}
        self.gateway: subprocess.Popen | None = None
        self.gw_url = ""
        self.model = ""

    def template(self, extra: str = "") -> str:
        return (f"{sys.executable} {LAUNCHER} --state {self.tmp} --model {self.model_dir} "
                f"--redis-url {self.redis.url} --heartbeat {HEARTBEAT} --node-id {{node_id}} --port {{port}} "
                f"--version {{version}} {extra}").strip()

    def url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.ports[node]}"

    def pid(self, node: str) -> int:
        return int((self.tmp / f"{node}.pid").read_text())

    def start_backends(self, version: str) -> None:
        procs = [subprocess.Popen(self.template().format(node_id=n, port=self.ports[n], version=version),
                                  shell=True, env=_env()) for n in NODES]
        assert [p.wait(timeout=240) for p in procs] == [0, 0, 0]
        self.model = requests.get(self.url(NODES[0]) + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()["model"]

    def start_gateway(self) -> None:
        port = free_port()
        cfg = self.tmp / "gateway.toml"
        cfg.write_text(f"""
[server]
port = {port}
redis_url = "{self.redis.url}"
index_fill = "backends"
page_seed = "{SEED}"
health_interval_s = 0.25
health_stale_intervals = 12          # 3 s: a real backend on a busy 2-core box can take > 0.5 s to answer
admin_key_sha256 = "{hash_key(ADMIN_KEY)}"
access_log = false

[[models]]
name = "{self.model}"
tokenizer = "{self.model_dir}"

[[tenants]]
id = "ops-tenant"
api_key_sha256 = ["{hash_key(TENANT_KEY)}"]
models = ["*"]
""")
        self.gw_url = f"http://127.0.0.1:{port}"
        self.gateway = subprocess.Popen([sys.executable, "-m", "edgeinfer.ops.cli", "gateway", "--config", str(cfg)],
                                        cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                                        stderr=open(self.tmp / "gateway.log", "ab"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.gateway.poll() is None, (self.tmp / "gateway.log").read_text()[-2000:]
            if len(self.routable()) == len(NODES):
                return
            time.sleep(0.2)
        raise TimeoutError(f"gateway does not see the 3 nodes: {self.gateway_nodes()}")

    def gateway_nodes(self) -> dict:
        try:
            return requests.get(self.gw_url + "/admin/nodes", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                                timeout=2).json()
        except (requests.RequestException, ValueError):
            return {}

    def routable(self) -> set[str]:
        return {n for n, d in self.gateway_nodes().items() if d["routable"]}

    def ops(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgeinfer.ops.cli", "ops", *args, "--redis-url", self.redis.url],
                              cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)

    def versions(self) -> dict[str, str]:
        return {n: requests.get(self.url(n) + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()["version"] for n in NODES}

    def status(self) -> dict[str, dict]:
        r = self.ops("status", "--json")
        assert r.returncode == 0, r.stderr
        return {d["node_id"]: d for d in json.loads(r.stdout)}

    def stop(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.terminate()
            try:
                self.gateway.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
        for n in NODES:
            pidfile = self.tmp / f"{n}.pid"
            if pidfile.exists():
                try:
                    os.kill(int(pidfile.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def stream_once(gw_url: str, model: str, max_tokens: int = 6, timeout: float = 120) -> dict:
    """One streaming chat request; the outcome of reading the SSE stream to its end."""
    body = {"model": model, "messages": [{"role": "user", "content": "Count: one, two,"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    out = {"status": None, "finish": None, "done": False, "error": None, "text": ""}
    try:
        with requests.post(gw_url + "/v1/chat/completions", json=body, stream=True, timeout=timeout,
                           headers={"authorization": f"Bearer {TENANT_KEY}"}) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = r.text[:300]
                return out
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    out["done"] = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    out["error"] = ev["error"]
                    continue
                for ch in ev.get("choices", []):
                    out["text"] += ch["delta"].get("content") or ""
                    out["finish"] = ch.get("finish_reason") or out["finish"]
    except requests.RequestException as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def ok(res: dict) -> bool:
    return res["status"] == 200 and res["done"] and res["error"] is None and res["finish"] in ("stop", "length")


class Clients:
    """Continuous streaming clients (bounded by time and count) while an operation runs."""

    def __init__(self, cluster: Cluster, threads: int = 3, max_requests: int = 2000) -> None:
        self.gw_url = cluster.gw_url
        self.model = cluster.model
        self.results: list[dict] = []
        self.stop_event = threading.Event()
        self.max_requests = max_requests
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]

    def _loop(self) -> None:
        while not self.stop_event.is_set() and len(self.results) < self.max_requests:
            self.results.append(stream_once(self.gw_url, self.model))

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=120)

    def failures(self) -> list[dict]:
        return [r for r in self.results if not ok(r)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smol_dir):
    redis = ValkeyServer().start()
    c = Cluster(tmp_path_factory.mktemp("ops"), Path(smol_dir), redis)
    try:
        c.start_backends("v1")
        c.start_gateway()
        yield c
    finally:
        c.stop()
        redis.stop()


def test_status_and_operator_key(cluster):
    st = cluster.status()
    assert set(st) == set(NODES)
    assert all(d["version"] == "v1" and d["state"] == "active" and d["model"] == cluster.model for d in st.values())
    table = cluster.ops("status")
    assert table.returncode == 0 and "CACHE HIT" in table.stdout and all(n in table.stdout for n in NODES)

    node = cluster.url("n0")
    for auth in (f"Bearer {TENANT_KEY}", f"Bearer {ADMIN_KEY}", "Bearer wrong", ""):
        r = requests.post(node + "/admin/drain", headers={"authorization": auth} if auth else {}, timeout=5)
        assert r.status_code == 401, auth
    r = requests.get(cluster.gw_url + "/admin/nodes", headers={"authorization": f"Bearer {TENANT_KEY}"}, timeout=5)
    assert r.status_code == 401
    r = requests.get(cluster.gw_url + "/admin/nodes", headers={"authorization": f"Bearer {OPERATOR_KEY}"}, timeout=5)
    assert r.status_code == 401
    bad = subprocess.run([sys.executable, "-m", "edgeinfer.ops.cli", "ops", "drain", "n0", "--redis-url", cluster.redis.url],
                         cwd=REPO, env={**_env(), "EDGEINFER_OPERATOR_KEY": TENANT_KEY}, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "operator key" in bad.stderr
    assert requests.get(node + "/ready", timeout=5).status_code == 200

    d = cluster.ops("drain", "n0", "--deadline", "30")
    assert d.returncode == 0, d.stdout + d.stderr
    assert requests.get(node + "/ready", timeout=5).status_code == 503
    deadline = time.monotonic() + HEARTBEAT * 2
    while "n0" in cluster.routable() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "n0" not in cluster.routable()
    assert cluster.status()["n0"]["state"] == "draining"
    assert ok(stream_once(cluster.gw_url, cluster.model))           # served by the other two
    u = cluster.ops("undrain", "n0")
    assert u.returncode == 0, u.stderr
    assert cluster.status()["n0"]["state"] == "active"
    unknown = cluster.ops("drain", "nope")
    assert unknown.returncode == 2 and "unknown node 'nope'" in unknown.stderr


def test_rollout_with_continuous_traffic_has_zero_failed_requests(cluster):
    dry = cluster.ops("rollout", "--model", cluster.model, "--to", "v2", "--command", cluster.template(),
                      "--dry-run")
    assert dry.returncode == 0 and dry.stdout.count("v1 -> v2") == 3 and "dry run" in dry.stdout
    assert cluster.versions() == dict.fromkeys(NODES, "v1")

    with Clients(cluster) as clients:
        time.sleep(1.0)
        r = cluster.ops("rollout", "--model", cluster.model, "--to", "v2",
                        "--command", cluster.template("--start-drained"), "--settle", "0.6", "--health-timeout", "120")
        time.sleep(0.5)
        during = len(clients.results)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rollout done: 3 node(s) serve v2" in r.stdout
    assert r.stdout.count("canary ok") == 3
    assert r.stdout.count("healthy at v2, draining; canary request") == 3    # no traffic before the canary
    assert "already active" not in r.stdout
    assert cluster.versions() == dict.fromkeys(NODES, "v2")
    assert {n: d["version"] for n, d in cluster.status().items()} == dict.fromkeys(NODES, "v2")
    assert during >= 10, f"only {during} client requests ran during the rollout"
    assert clients.failures() == [], f"{len(clients.failures())} of {len(clients.results)} failed"
    deadline = time.monotonic() + 5
    while cluster.routable() != set(NODES) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.routable() == set(NODES)


def test_rollout_with_failing_version_rolls_back(cluster):
    assert cluster.versions() == dict.fromkeys(NODES, "v2")
    template = cluster.template("--break-node n1 --break-version v3")
    with Clients(cluster, threads=2) as clients:
        r = cluster.ops("rollout", "--model", cluster.model, "--to", "v3", "--command", template,
                        "--settle", "0.6")
    print(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "n1: FAILED: command exited with 1" in r.stdout
    assert "n0: healthy at v3, and already active" in r.stdout     # no --start-drained: the rollout says so
    assert "rolled back" in r.stdout and "n2" not in r.stdout.split("rolling back")[1].split("\n")[0]
    assert cluster.versions() == dict.fromkeys(NODES, "v2")       # n0 was upgraded, then put back
    assert {n: (d["version"], d["state"]) for n, d in cluster.status().items()} == dict.fromkeys(NODES,
                                                                                                 ("v2", "active"))
    assert clients.failures() == [], clients.failures()[:3]


def test_sigkill_mid_stream(cluster):
    deadline = time.monotonic() + 5
    while cluster.routable() != set(NODES) and time.monotonic() < deadline:
        time.sleep(0.1)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(stream_once(cluster.gw_url, cluster.model, max_tokens=400)))
    t.start()
    victim = None
    deadline = time.monotonic() + 30
    while victim is None and time.monotonic() < deadline:
        for n in NODES:
            h = requests.get(cluster.url(n) + "/health", timeout=5).json()
            if h["running"]:
                victim = n
        time.sleep(0.05)
    assert victim is not None, "the long request never reached a backend"
    time.sleep(0.3)                    # well into decoding
    os.kill(cluster.pid(victim), signal.SIGKILL)
    killed_at = time.monotonic()
    t.join(timeout=30)
    assert result["status"] == 200 and result["done"], result
    assert result["error"] is not None and result["finish"] is None, result     # clean error event, then [DONE]

    while victim in cluster.routable():
        assert time.monotonic() - killed_at < HEARTBEAT, "gateway still routes to the dead node"
        time.sleep(0.02)
    for _ in range(4):
        assert ok(stream_once(cluster.gw_url, cluster.model))
    while command(cluster.redis.port, "EXISTS", f"ei:node:{victim}").startswith(b":1"):
        assert time.monotonic() - killed_at < 3 * HEARTBEAT + 0.5, "registry still holds the dead node"
        time.sleep(0.05)
    assert set(cluster.status()) == set(NODES) - {victim}
