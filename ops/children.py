"""The child processes `edgeinfer serve` starts (valkey, the backend), stopped by pid whatever ends the parent.

Each child runs in its own session (a Ctrl-C in the terminal reaches only `serve`, which stops the children
in order: backend first, then valkey, which saves its pages) and is stopped with its whole process group, so
what it started itself (the first start's kernel compile: ninja, c++, cc1plus) stops with it instead of
running on as orphans; on Linux it also runs with PR_SET_PDEATHSIG, so the
kernel sends it SIGTERM if `serve` itself dies without cleaning up (SIGKILL, a crash). `Children.stop_all`
runs on normal exit, on SIGINT/SIGTERM (also during the first start, before the gateway's own loop handles
them) and from a finally block.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):   # not glibc / not Linux: the parent's cleanup is the only guard
        pass


class Children:
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: Sequence[str], *, env: dict[str, str] | None = None, stdout=None,
              stderr=None) -> subprocess.Popen:
        proc = subprocess.Popen(list(cmd), env=env, stdout=stdout, stderr=stderr, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        self.procs.append((name, proc))
        return proc

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each child's process group, newest first (the backend before the valkey it writes to), then
        wait for the child; SIGKILL the group if the child outlives timeout_s, and whatever of its group is
        left once it has exited (a compiler it started)."""
        while self.procs:
            name, proc = self.procs.pop()
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    print(f"edgeinfer serve: {name} (pid {proc.pid}) did not stop in {timeout_s:.0f} s: killed",
                          file=sys.stderr, flush=True)
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
            _signal_group(proc, signal.SIGKILL)     # its group's leftovers; none: ProcessLookupError, ignored


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Signal the child's process group (its pid: start_new_session made it the leader)."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:     # the group id was reused by someone else's process: the child alone
        if proc.poll() is None:
            proc.send_signal(signum)


class Stopped(Exception):
    """Raised in the main thread by SIGTERM/SIGINT while `serve` is starting up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_stop_signals() -> None:
    """Until the gateway's event loop installs its own handlers: SIGTERM and SIGINT raise `Stopped`, so the
    caller's finally block stops the children (a plain SIGTERM would end the process and skip it)."""
    def handler(signum, frame):
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def exit_code(signum: int) -> int:
    return 128 + signum if signum > 0 else 1

