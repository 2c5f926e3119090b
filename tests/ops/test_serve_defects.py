"""`edgeinfer serve` as a new user and an operator run it (issue 39): a stop during the first start's kernel
compile leaves no orphan compiler and no lock that stalls the next start; an immediate restart is not refused
for a port in TIME_WAIT; a second serve on the same home is refused in one line while the first runs."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from edgeinfer.kernels.cpu import _build_lock
from edgeinfer.ops.children import Children
from edgeinfer.ops.serve import port_in_use
from tests.ops.launcher import alive

EDGEINFER = Path(sys.executable).with_name("edgeinfer")   # the console script pip installed

# a child that starts a grandchild in its own process group (as torch's build starts ninja -> c++ -> cc1plus)
# and ignores SIGTERM until it has written the grandchild's pid, like a backend busy compiling
_PARENT = """
import signal, subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(g.pid, flush=True)
time.sleep(300)
"""


def test_stopping_a_child_stops_what_it_started():
    children = Children()
    proc = children.start("backend", [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE)
    grandchild = int(proc.stdout.readline())
    assert alive(grandchild)
    children.stop_all(timeout_s=10)
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the child's own child outlived it (an orphan compiler)"
    assert proc.poll() is not None


def test_a_stale_torch_build_lock_is_removed_with_one_line(tmp_path, caplog):
    build = tmp_path / "edgeinfer_cpu_q4"
    build.mkdir()
    (build / "lock").write_text("")        # what torch's FileBaton leaves when its build is killed
    with caplog.at_level(logging.INFO, logger="edgeinfer"):
        with _build_lock(build):
            assert not (build / "lock").exists()
    lines = [r.getMessage() for r in caplog.records if "stale build lock" in r.getMessage()]
    assert len(lines) == 1 and str(build / "lock") in lines[0], lines


def test_a_live_builder_is_waited_for_not_robbed_of_its_lock(tmp_path):
    build = tmp_path / "ext"
    build.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from edgeinfer.kernels.cpu import _build_lock\n"
        f"with _build_lock(Path({str(build)!r})):\n"
        f"    Path({str(build / 'lock')!r}).write_text('')\n"
        "    print('holding', flush=True); time.sleep(1.5)\n"
        f"    Path({str(build / 'lock')!r}).unlink()\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        t0 = time.monotonic()
        with _build_lock(build):
            waited = time.monotonic() - t0
            assert not (build / "lock").exists()
        assert waited > 0.5          # it waited for the live build instead of deleting its lock under it
    finally:
        holder.wait(timeout=30)
    assert holder.returncode == 0


def test_a_port_in_time_wait_is_free_and_a_listening_one_is_not():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as aiohttp's and valkey's servers bind
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        c = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        assert port_in_use("127.0.0.1", port)            # listening: in use
        conn.close()                                     # the server side closes first: its port in TIME_WAIT
        c.close()
    time.sleep(0.1)
    states = subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True, text=True).stdout \
        if os.path.exists("/usr/bin/ss") or os.path.exists("/bin/ss") else ""
    assert port_in_use("127.0.0.1", port) is None, states


def test_a_second_serve_on_the_same_home_is_refused_in_one_line(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}
    env["EDGEINFER_HOME"] = str(home)
    first = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom edgeinfer.ops.local_state import HomeLock\n"
        "lock = HomeLock.take()\nassert not isinstance(lock, str), lock\nprint('owner', flush=True)\n"
        "time.sleep(120)\n")], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "owner"
        port = _free_port()
        r = subprocess.run([str(EDGEINFER), "serve", "--port", str(port)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and str(home) in lines[0], lines
    assert not (home / "valkey").exists()          # refused before anything started on that home
    # the owner gone, the home is free again (the flock died with it)
    from edgeinfer.ops.local_state import HomeLock

    os.environ["EDGEINFER_HOME"] = str(home)
    try:
        lock = HomeLock.take()
        assert not isinstance(lock, str), lock
        lock.release()
    finally:
        del os.environ["EDGEINFER_HOME"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
