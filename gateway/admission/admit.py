"""Admission of one request: the tenant's rate limits and its concurrent-stream cap, decided together; and
the request's end: its lease released and its completion tokens charged.

Admission (in-process, or with Redis down) runs the two limiters one after the other, cap first. RedisAdmission
runs both in one Lua script (lua.py) per request and one at its end (keys `ei:rl:{t}:*` and `ei:cc:{t}` share the
tenant's hash tag, so one cluster slot): each Redis round trip costs the gateway ~60-70 us of CPU in
redis-py, which is most of what a Redis-backed gateway spends per request (benchmarks/serving/gateway.py
--redis). A request the cap refuses consumes no rate budget; one the rate limit refuses takes no lease.
Admission runs before the prompt is tokenized (tokens at cost 0); `charge_prompt` charges the counted
prompt tokens after (a third round trip, only for tenants with tokens_per_min).

Cancellation: a client that resets while its admission is in Redis cancels the handler; the script runs
anyway (it was sent), so RedisAdmission.admit runs under asyncio.shield and gives back a lease whose
caller is gone. The in-process path never suspends, so a cancellation cannot split it.
"""

from __future__ import annotations

import asyncio
import logging
import os

from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.gateway.admission.leases import Lease, LocalStreamLimiter, RedisStreamLimiter
from edgeinfer.gateway.admission.lua import ADMIT, CHARGE, FINISH
from edgeinfer.gateway.admission.ratelimit import UNLIMITED, WINDOW_MS, Decision, LocalLimiter, limits_of
from edgeinfer.gateway.config import TenantConfig
from edgeinfer.protocol.defaults import KEY_PREFIX

log = logging.getLogger(__name__)


def _decision(out: list, limits: list[tuple[str, float, int]]) -> Decision:
    """lua.GCRA_LUA's `out` as a Decision."""
    allowed, retry_ms, by = int(out[0]), int(out[1]), int(out[2])
    remaining, reset = {}, {}
    for i, (name, _, _) in enumerate(limits):
        remaining[name] = int(out[3 + 2 * i])
        reset[name] = int(out[4 + 2 * i]) / 1000.0
    return Decision(bool(allowed), retry_ms / 1000.0, limits[by - 1][0] if by else "", remaining, reset)


def _in_process(limiter: LocalLimiter, streams: LocalStreamLimiter, tenant: TenantConfig,
                tokens: int) -> tuple[Decision, Lease | None]:
    """The cap first, so a refused request spends no rate budget; a rate refusal gives the lease back."""
    lease = streams.acquire_local(tenant)
    if lease is None:
        return UNLIMITED, None
    decision = limiter.acquire(tenant, tokens)
    if not decision.allowed:
        streams.release_local(lease)
        return decision, None
    return decision, lease


class Admission:
    """In-process: the stream count, then the GCRA limiter (see _in_process)."""

    failures = 0

    def __init__(self) -> None:
        self.limiter = LocalLimiter()
        self.streams = LocalStreamLimiter()

    async def admit(self, tenant: TenantConfig, tokens: int) -> tuple[Decision, Lease | None]:
        """(rate decision, lease). Not admitted: decision.allowed is False (rate), or lease is None (cap)."""
        return _in_process(self.limiter, self.streams, tenant, tokens)

    def finish_now(self, tenant: TenantConfig, lease: Lease, completion_tokens: int) -> bool:
        """Settle the request's end (lease back, completion tokens charged). False: nothing was done, call
        `finish` from a task (it needs Redis)."""
        self.streams.release_local(lease)
        self.limiter.charge(tenant, completion_tokens)
        return True

    async def finish(self, tenant: TenantConfig, lease: Lease, completion_tokens: int) -> None:
        self.finish_now(tenant, lease, completion_tokens)

    async def charge_prompt(self, tenant: TenantConfig, tokens: int) -> Decision:
        """The prompt's tokens against tokens_per_min (checked); after admit, once they are counted."""
        return self.limiter.acquire(tenant, tokens, requests=False)




class RedisAdmission:
    """Shared by every gateway on the same Redis: one Lua call to admit, one to settle (module docstring).
    Redis down or slow (> timeout_s): the in-process limits, counted in `failures` and logged."""

    def __init__(self, client, prefix: str = KEY_PREFIX, ttl_s: float = 30.0, timeout_s: float = 0.25) -> None:
        self.keys = KeySpace(prefix)
        self.timeout_s = timeout_s
        self.fallback = LocalLimiter()
        self.streams = RedisStreamLimiter(client, prefix, ttl_s, timeout_s)
        self._failures = 0
        self._admit = client.register_script(ADMIT)
        self._finish = client.register_script(FINISH)
        self._charge = client.register_script(CHARGE)
        self.orphans: set[asyncio.Future] = set()   # admissions whose caller was cancelled, until settled

    @property
    def failures(self) -> int:
        return self._failures + self.streams.failures

    def _failed(self, what: str, e: Exception) -> None:
        self._failures += 1
        if self._failures == 1 or self._failures % 1000 == 0:
            log.warning("redis admission %s failed (%s: %s); using the in-process limits", what,
                        type(e).__name__, e)

    async def run(self) -> None:
        await self.streams.run()

    async def admit(self, tenant: TenantConfig, tokens: int) -> tuple[Decision, Lease | None]:
        """Shielded: if the caller is cancelled, the script still finishes and its lease is given back."""
        task = asyncio.ensure_future(self._admit_once(tenant, tokens))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.orphans.add(task)
            task.add_done_callback(lambda t: self._give_back(tenant, t))
            raise

    def _give_back(self, tenant: TenantConfig, task: asyncio.Future) -> None:
        self.orphans.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        lease = task.result()[1]
        if lease is not None and not self.finish_now(tenant, lease, 0):
            back = asyncio.ensure_future(self.finish(tenant, lease, 0))
            self.orphans.add(back)
            back.add_done_callback(self.orphans.discard)

    async def _admit_once(self, tenant: TenantConfig, tokens: int) -> tuple[Decision, Lease | None]:
        limits = limits_of(tenant, tokens)
        cap = tenant.max_concurrent_streams
        if not limits and not cap:
            return UNLIMITED, Lease(tenant.id, "", "none")
        lease_id = os.urandom(12).hex() if cap else ""
        args: list = [len(limits), WINDOW_MS]
        for _, interval, cost in limits:
            args += [repr(interval), cost]
        args += [cap, lease_id, self.streams.ttl_ms]
        keys = [self.keys.rate(tenant.id, name) for name, _, _ in limits] + [self.keys.leases(tenant.id)]
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await self._admit(keys=keys, args=args)
        except Exception as e:  # Redis down or slow: the in-process limits
            self._failed("admit", e)
            return _in_process(self.fallback, self.streams.local, tenant, tokens)
        if int(out[0]) == -1:
            return UNLIMITED, None
        decision = _decision(out, limits)
        if not decision.allowed:
            return decision, None
        if not cap:
            return decision, Lease(tenant.id, "", "none")
        self.streams.hold(tenant.id, lease_id)
        return decision, Lease(tenant.id, lease_id, "redis")

    def finish_now(self, tenant: TenantConfig, lease: Lease, completion_tokens: int) -> bool:
        if lease.kind == "redis" or (completion_tokens and tenant.tokens_per_min):
            return False
        self.streams.release_local(lease)
        return True

    async def finish(self, tenant: TenantConfig, lease: Lease, completion_tokens: int) -> None:
        if lease.kind == "redis":
            self.streams.drop(tenant.id, lease.lease_id)
        else:
            self.streams.release_local(lease)
        interval = WINDOW_MS / tenant.tokens_per_min if tenant.tokens_per_min else 0
        args = [lease.lease_id if lease.kind == "redis" else "", WINDOW_MS, repr(interval), completion_tokens]
        keys = [self.keys.rate(tenant.id, "tokens"), self.keys.leases(tenant.id)]
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._finish(keys=keys, args=args)
        except Exception as e:  # the lease expires by itself; the tokens are charged in-process
            self._failed("finish", e)
            self.fallback.charge(tenant, completion_tokens)

    async def charge_prompt(self, tenant: TenantConfig, tokens: int) -> Decision:
        limits = limits_of(tenant, tokens, requests=False)
        if not limits or tokens <= 0:
            return UNLIMITED
        _, interval, cost = limits[0]
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await self._charge(keys=[self.keys.rate(tenant.id, "tokens")],
                                         args=[1, WINDOW_MS, repr(interval), cost])
        except Exception as e:  # Redis down or slow: the in-process limits
            self._failed("charge", e)
            return self.fallback.acquire(tenant, tokens, requests=False)
        return _decision(out, limits)
