"""Admission of one request: the tenant's rate limits and its concurrent-stream cap, decided together; and
the request's end: its lease released and its completion tokens charged.

Admission (in-process, or with Redis down) runs the two limiters one after the other, cap first. RedisAdmission
runs both in one Lua script per request and one at its end (keys `ei:rl:{t}:*` and `ei:cc:{t}` share the
tenant's hash tag, so one cluster slot): each Redis round trip costs the gateway ~60-70 us of CPU in
redis-py, which is most of what a Redis-backed gateway spends per request (benchmarks/bench_gateway.py
--redis). A request the cap refuses consumes no rate budget; one the rate limit refuses takes no lease.
"""

from __future__ import annotations

import asyncio
import logging
import os

from gateway.config import TenantConfig
from gateway.ratelimit import GCRA_LUA, UNLIMITED, WINDOW_MS, Decision, LocalLimiter, RedisLimiter, _limits
from gateway.streams import Lease, LocalStreamLimiter, RedisStreamLimiter

log = logging.getLogger(__name__)


def _in_process(limiter: LocalLimiter, streams: LocalStreamLimiter, tenant: TenantConfig,
                tokens: int) -> tuple[Decision, Lease | None]:
    """The cap first, so a refused request spends no rate budget; a rate refusal gives the lease back."""
    lease = streams.acquire_local(tenant)
    if lease is None:
        return UNLIMITED, None
    decision = limiter.acquire_now(tenant, tokens)
    if not decision.allowed:
        streams.release_local(lease)
        return decision, None
    return decision, lease


class Admission:
    """In-process: the stream count, then the GCRA limiter (see _in_process)."""

    def __init__(self, limiter: LocalLimiter, streams: LocalStreamLimiter) -> None:
        self.limiter = limiter
        self.streams = streams

    async def admit(self, tenant: TenantConfig, tokens: int) -> tuple[Decision, Lease | None]:
        """(rate decision, lease). Not admitted: decision.allowed is False (rate), or lease is None (cap)."""
        return _in_process(self.limiter, self.streams, tenant, tokens)

    def finish_now(self, tenant: TenantConfig, lease: Lease, completion_tokens: int) -> bool:
        """Settle the request's end (lease back, completion tokens charged). False: nothing was done, call
        `finish` from a task (it needs Redis)."""
        self.streams.release_local(lease)
        if completion_tokens:
            self.limiter.charge_now(tenant, completion_tokens)
        return True

    async def finish(self, tenant: TenantConfig, lease: Lease, completion_tokens: int) -> None:
        self.finish_now(tenant, lease, completion_tokens)


_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local n = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local force = false
local cap = tonumber(ARGV[3 + 2 * n])
local cc = KEYS[n + 1]
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', cc, '-inf', now)
  if redis.call('ZCARD', cc) >= cap then return {-1} end
end
""" + GCRA_LUA + """
if allowed == 1 and cap > 0 then
  local ttl = tonumber(ARGV[5 + 2 * n])
  redis.call('ZADD', cc, math.floor(now) + ttl, ARGV[4 + 2 * n])
  redis.call('PEXPIRE', cc, ttl)
end
return out
"""

_FINISH = """
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[2], ARGV[1]) end
local interval = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
if interval > 0 and cost > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  local tat = tonumber(redis.call('GET', KEYS[1]) or now)
  if tat < now then tat = now end
  local new = tat + cost * interval
  redis.call('SET', KEYS[1], string.format('%.3f', new), 'PX', math.ceil(new - now) + 1)
end
return 1
"""


class RedisAdmission:
    """Shared by every gateway on the same Redis: one Lua call to admit, one to settle (module docstring)."""

    def __init__(self, limiter: RedisLimiter, streams: RedisStreamLimiter) -> None:
        self.limiter = limiter
        self.streams = streams
        self.failures = 0
        self._admit = limiter.client.register_script(_ADMIT)
        self._finish = limiter.client.register_script(_FINISH)

    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 1000 == 0:
            log.warning("redis admission %s failed (%s: %s); using the in-process limits", what,
                        type(e).__name__, e)

    async def admit(self, tenant: TenantConfig, tokens: int) -> tuple[Decision, Lease | None]:
        limits = _limits(tenant, tokens)
        cap = tenant.max_concurrent_streams
        if not limits and not cap:
            return UNLIMITED, Lease(tenant.id, "", "none")
        lease_id = os.urandom(12).hex() if cap else ""
        args: list = [len(limits), WINDOW_MS]
        for _, interval, cost in limits:
            args += [repr(interval), cost]
        args += [cap, lease_id, self.streams.ttl_ms]
        keys = [self.limiter._key(tenant.id, name) for name, _, _ in limits] + [self.streams.key(tenant.id)]
        try:
            async with asyncio.timeout(self.limiter.timeout_s):
                out = await self._admit(keys=keys, args=args)
        except Exception as e:  # Redis down or slow: the in-process limits, as each limiter does alone
            self._failed("admit", e)
            return _in_process(self.limiter.fallback, self.streams.local, tenant, tokens)
        if int(out[0]) == -1:
            return UNLIMITED, None
        allowed, retry_ms, by = int(out[0]), int(out[1]), int(out[2])
        remaining, reset = {}, {}
        for i, (name, _, _) in enumerate(limits):
            remaining[name] = int(out[3 + 2 * i])
            reset[name] = int(out[4 + 2 * i]) / 1000.0
        decision = Decision(bool(allowed), retry_ms / 1000.0, limits[by - 1][0] if by else "", remaining, reset)
        if not decision.allowed:
            return decision, None
        if not cap:
            return decision, Lease(tenant.id, "", "none")
        self.streams.held.setdefault(tenant.id, set()).add(lease_id)
        return decision, Lease(tenant.id, lease_id, "redis")

    def finish_now(self, tenant: TenantConfig, lease: Lease, completion_tokens: int) -> bool:
        if lease.kind == "redis" or (completion_tokens and tenant.tokens_per_min):
            return False
        self.streams.release_local(lease)
        return True

    async def finish(self, tenant: TenantConfig, lease: Lease, completion_tokens: int) -> None:
        if lease.kind != "redis":
            self.streams.release_local(lease)
        else:
            ids = self.streams.held.get(tenant.id)
            if ids is not None:
                ids.discard(lease.lease_id)
                if not ids:
                    del self.streams.held[tenant.id]
        interval = WINDOW_MS / tenant.tokens_per_min if tenant.tokens_per_min else 0
        args = [lease.lease_id if lease.kind == "redis" else "", repr(interval), completion_tokens]
        keys = [self.limiter._key(tenant.id, "tokens"), self.streams.key(tenant.id)]
        try:
            async with asyncio.timeout(self.limiter.timeout_s):
                await self._finish(keys=keys, args=args)
        except Exception as e:  # the lease expires by itself; the tokens are charged in-process
            self._failed("finish", e)
            if completion_tokens:
                self.limiter.fallback.charge_now(tenant, completion_tokens)
