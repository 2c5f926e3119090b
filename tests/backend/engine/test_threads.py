"""The engine's thread count follows the cores other processes leave free (backend/engine/threads.py).

The decision logic is tested with injected tick counters (the readers of /proc are the only part replaced);
one test reads the real /proc of this machine."""

from __future__ import annotations

import pytest

from edgeinfer.backend.engine.threads import ThreadGovernor


class Ticks:
    """A machine of `cores` cores, 100 ticks per second per core: this process uses `own`, others `others`."""

    def __init__(self) -> None:
        self.t, self.machine, self.own = 0.0, 0, 0

    def advance(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.t += seconds
        self.own += round(100 * seconds * own_cores)
        self.machine += round(100 * seconds * (own_cores + other_cores))


def governor(ticks: Ticks, max_threads: int = 2, cores: int = 2) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    g = ThreadGovernor(max_threads, 0.5, lambda: ticks.machine, lambda: ticks.own, calls.append,
                       lambda: ticks.t, cores)
    g.hz = 100
    return g, calls


def test_a_busy_neighbour_on_one_core_takes_a_thread_away_and_gives_it_back():
    ticks = Ticks()
    g, calls = governor(ticks)
    assert g.enabled and g.maybe_adjust() == 2 and calls == []
    ticks.advance(0.5, own_cores=1.0, other_cores=1.0)          # a hog holds one core
    assert g.maybe_adjust() == 2 and calls == []                 # seen once: not yet
    assert g.others_cores == pytest.approx(1.0)
    ticks.advance(0.5, own_cores=1.0, other_cores=1.0)
    assert g.maybe_adjust() == 1 and calls == [1]                # seen twice: one thread
    ticks.advance(0.5, own_cores=1.0, other_cores=0.0)           # the hog left
    assert g.maybe_adjust() == 1
    ticks.advance(0.5, own_cores=1.0, other_cores=0.05)
    assert g.maybe_adjust() == 2 and calls == [1, 2] and g.changes == 2


def test_light_background_load_and_a_single_burst_change_nothing():
    ticks = Ticks()
    g, calls = governor(ticks)
    for other in (0.2, 0.3, 1.0, 0.1, 0.4, 0.0):                 # one 1-core burst among light load
        ticks.advance(0.5, own_cores=2.0, other_cores=other)
        assert g.maybe_adjust() == 2
    assert calls == []


def test_between_reads_nothing_is_read_and_the_count_stays_within_bounds():
    ticks = Ticks()
    g, calls = governor(ticks, max_threads=4, cores=4)
    ticks.advance(0.1, own_cores=1.0, other_cores=8.0)
    assert g.maybe_adjust() == 4 and g.others_cores == 0.0       # under interval_s: not read
    for _ in range(2):
        ticks.advance(0.5, own_cores=1.0, other_cores=8.0)       # others use more than every core
        g.maybe_adjust()
    assert g.threads == 1 and calls == [1]                       # never below one thread


def test_one_thread_or_no_proc_does_nothing():
    ticks = Ticks()
    g, calls = governor(ticks, max_threads=1)
    ticks.advance(1.0, own_cores=1.0, other_cores=1.0)
    assert not g.enabled and g.maybe_adjust() == 1 and calls == []

    def gone() -> int:
        raise OSError("no /proc")
    g2 = ThreadGovernor(2, 0.5, gone, gone, calls.append, lambda: 0.0, 2)
    assert not g2.enabled and g2.maybe_adjust() == 2 and calls == []


def test_it_reads_this_machines_proc():
    g = ThreadGovernor(2, 0.0, set_threads=lambda n: None)
    if not g.enabled:
        pytest.skip("no /proc/stat here")
    sum(i * i for i in range(200_000))
    g.maybe_adjust()
    assert 0.0 <= g.others_cores <= g.cores + 1.0                # a sane reading, in cores
    assert 1 <= g.threads <= 2
