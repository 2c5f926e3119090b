"""Redis calls that never block or break the caller.

`RedisGuard.run` bounds every call by a short timeout and turns any Redis or
socket failure into the caller's fallback value (a miss, False, []). After a
failure the breaker opens: calls are skipped (fallback at once, no I/O) for
`backoff_s`, doubling up to `max_backoff_s` while failures continue; then one
probe call is let through (half-open) and a success closes the breaker.
One guard per Redis deployment, shared by the store, index and registry that
talk to it, so one component's failure spares the others the wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import RedisError, ResponseError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class GuardStats:
    calls: int = 0
    ok: int = 0
    errors: int = 0  # connection errors, cluster errors, timeouts
    timeouts: int = 0
    command_errors: int = 0  # ResponseError: a bug or misconfiguration, does not trip the breaker
    skipped: int = 0  # answered with the fallback while the breaker was open
    trips: int = 0


class RedisGuard:
    def __init__(self, timeout_s: float = 0.1, backoff_s: float = 0.25, max_backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(f"need timeout_s > 0, 0 < backoff_s <= max_backoff_s; got "
                             f"{timeout_s}, {backoff_s}, {max_backoff_s}")
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stats = GuardStats()
        self._clock = clock
        self._open_until = 0.0
        self._current_backoff = backoff_s
        self._failing = False
        self._probe_in_flight = False

    @property
    def is_open(self) -> bool:
        """True while calls are being skipped."""
        return self._failing and (self._clock() < self._open_until or self._probe_in_flight)

    async def run(self, op: Callable[[], Awaitable[T]], fallback: T, what: str,
                  timeout_s: float | None = None, *, force: bool = False) -> T:
        """Await op() within the timeout; on any failure (or while open) return `fallback`.

        force: run even while the breaker is open (for a rare call off the request path, such as the
        registry heartbeat, so a node is back in a restarted Redis at its next beat); a success closes
        it, a failure leaves it as it was (the other callers' backoff does not grow).
        """
        self.stats.calls += 1
        probe = bypass = False
        if self._failing:
            if self._clock() < self._open_until or self._probe_in_flight:
                if not force:
                    self.stats.skipped += 1
                    return fallback
                bypass = True
            else:
                probe = self._probe_in_flight = True
        try:
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                result = await op()
        except TimeoutError:
            self.stats.timeouts += 1
            self._trip(what, "timed out", bypass)
            return fallback
        except ResponseError as e:
            self.stats.command_errors += 1
            log.error("redis %s: command error: %s", what, e)
            self._recover()
            return fallback
        except (RedisError, OSError) as e:
            self._trip(what, f"{type(e).__name__}: {e}", bypass)
            return fallback
        finally:
            if probe:
                self._probe_in_flight = False
        self.stats.ok += 1
        self._recover()
        return result

    def _trip(self, what: str, why: str, bypass: bool = False) -> None:
        self.stats.errors += 1
        if bypass:      # a forced call through the open breaker: its failure changes nothing
            return
        if self._failing:
            self._current_backoff = min(self._current_backoff * 2, self.max_backoff_s)
        else:
            self.stats.trips += 1
            self._current_backoff = self.backoff_s
            log.warning("redis %s failed (%s); skipping redis for %.2fs", what, why, self._current_backoff)
        self._failing = True
        self._open_until = self._clock() + self._current_backoff

    def _recover(self) -> None:
        if self._failing:
            log.warning("redis is back after %d skipped calls", self.stats.skipped)
        self._failing = False
        self._current_backoff = self.backoff_s


def redis_client(url: str, *, cluster: bool = False, socket_timeout_s: float | None = 1.0):
    """A redis.asyncio client (or RedisCluster) that fails fast and leaves retrying to the guard.

    Binary responses (decode_responses=False): page bytes must stay bytes. socket_timeout_s None: no socket
    timeout (the caller bounds each call itself, as the gateway's admission does).
    """
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    kwargs: dict[str, Any] = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
                  retry=Retry(NoBackoff(), 0), decode_responses=False)
    if cluster:   # after a failover the slot map follows the promoted replica within a quarter second of errors
        return RedisCluster.from_url(url, topology_refresh_min_interval=0.25, **kwargs)
    return Redis.from_url(url, **kwargs)
