"""How many threads the engine's steps use, from the cores other processes leave free.

The CPU kernels split each op over torch's intra-op threads, and every op ends in a barrier: when another
process holds one of the cores, the thread that shares that core with it is descheduled for whole time slices
and every barrier waits for it. Measured on the 2-core VM, batch-1 decode through `edgeinfer serve` fell from
~155 to 2-68 tok/s while a busy loop ran beside it (docs/KERNELS.md). A step on fewer threads than cores only
slows down in proportion to the cores it gives up.

ThreadGovernor reads, every `interval_s`, the CPU time the whole machine spent busy (/proc/stat) and the time
this process spent (/proc/self/stat): the rest is what other processes used. The cores they leave free,
rounded, is the thread count (at least 1, at most the count the engine started with); a change must be seen
on two reads in a row before it is applied (one burst of another process does not flip it back and forth).
torch.set_num_threads is called from the engine thread, the thread that runs the ops. Without /proc (not
Linux) it does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def _machine_busy_ticks() -> int:
    """Busy ticks of all CPUs since boot: /proc/stat's first line less idle and iowait."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]   # user nice system idle iowait irq softirq steal


def _own_ticks() -> int:
    with open("/proc/self/stat") as f:
        rest = f.read().rpartition(")")[2].split()
    return int(rest[11]) + int(rest[12])             # utime + stime, every thread of this process


class ThreadGovernor:
    def __init__(self, max_threads: int | None = None, interval_s: float = 0.5,
                 machine_ticks: Callable[[], int] = _machine_busy_ticks, own_ticks: Callable[[], int] = _own_ticks,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic, cores: int | None = None) -> None:
        self.max_threads = max(1, max_threads or torch.get_num_threads())
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.cores = cores
        self.interval_s = interval_s
        self._machine, self._own, self._set, self._clock = machine_ticks, own_ticks, set_threads, clock
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.threads = self.max_threads
        self._pending: int | None = None
        self.others_cores = 0.0      # what other processes used over the last interval, in cores
        self.changes = 0
        self._last: tuple[float, int, int] | None
        try:
            self._last = (self._clock(), self._machine(), self._own())
        except (OSError, ValueError, IndexError):
            self._last = None        # no /proc: stay at max_threads

    @property
    def enabled(self) -> bool:
        return self._last is not None and self.max_threads > 1

    def maybe_adjust(self) -> int:
        """Called by the engine loop before each step; cheap between reads. Returns the thread count."""
        if self._last is None or self.max_threads <= 1:
            return self.threads
        now = self._clock()
        t0, m0, o0 = self._last
        if now - t0 < self.interval_s:
            return self.threads
        try:
            m1, o1 = self._machine(), self._own()
        except (OSError, ValueError, IndexError):
            return self.threads
        self._last = (now, m1, o1)
        self.others_cores = max(0.0, (m1 - m0) - (o1 - o0)) / self.hz / max(now - t0, 1e-9)
        want = max(1, min(self.max_threads, round(self.cores - self.others_cores)))
        if want == self.threads:
            self._pending = None
        elif self._pending == want:
            log.info("engine threads %d -> %d (other processes used %.2f of %d cores)", self.threads, want,
                     self.others_cores, self.cores)
            self._set(want)
            self.threads, self._pending = want, None
            self.changes += 1
        else:
            self._pending = want
        return self.threads
