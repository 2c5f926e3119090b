"""Per-tenant cap on concurrent requests (`max_concurrent_streams`), shared by every gateway.

RedisStreamLimiter keeps one sorted set per tenant, `<prefix>:cc:{<tenant>}`: member = a lease id (one per
running request), score = the lease's expiry on the Redis clock. Leases are taken and given back by
admit.py (in the same Lua script as the rate limits: drop expired leases, count, add if below
the cap), so N gateways share one cap without a race. This class holds the lease bookkeeping: a gateway
refreshes the leases it holds every ttl/3; a gateway that dies stops refreshing and its leases expire
after `ttl`, so a crash frees its share within one TTL instead of leaking it. Redis down or slow: the
gateway falls back to its own in-process count (`local`), as the rate limiter does.

LocalStreamLimiter is the in-process count, for single-node mode.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from edgeinfer.cache_store.keys import KeySpace
from edgeinfer.gateway.admission.lua import REFRESH
from edgeinfer.gateway.config import TenantConfig
from edgeinfer.protocol.defaults import KEY_PREFIX

log = logging.getLogger(__name__)


class Lease(NamedTuple):
    tenant: str
    lease_id: str
    kind: str           # "redis" (a lease in the tenant's set) | "local" (in-process count) | "none" (no cap)


class LocalStreamLimiter:
    def __init__(self) -> None:
        self.active: dict[str, int] = {}

    def acquire_local(self, tenant: TenantConfig) -> Lease | None:
        n = self.active.get(tenant.id, 0)
        if tenant.max_concurrent_streams and n >= tenant.max_concurrent_streams:
            return None
        self.active[tenant.id] = n + 1
        return Lease(tenant.id, "", "local")

    def release_local(self, lease: Lease) -> None:
        if lease.kind != "local":
            return
        n = self.active.get(lease.tenant, 0) - 1
        if n > 0:
            self.active[lease.tenant] = n
        else:
            self.active.pop(lease.tenant, None)




class RedisStreamLimiter:
    def __init__(self, client, prefix: str = KEY_PREFIX, ttl_s: float = 30.0, timeout_s: float = 0.25) -> None:
        if not ttl_s > 0 or ttl_s != ttl_s or ttl_s == float("inf"):
            raise ValueError(f"stream lease ttl_s={ttl_s!r}; expected a finite number > 0")
        self.client = client
        self.keys = KeySpace(prefix)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.local = LocalStreamLimiter()     # fallback when Redis fails
        self.failures = 0
        self.held: dict[str, set[str]] = {}   # tenant -> lease ids this gateway holds in Redis
        self._refresh = client.register_script(REFRESH)

    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 1000 == 0:
            log.warning("redis stream limiter %s failed (%s: %s); using the in-process count",
                        what, type(e).__name__, e)

    def release_local(self, lease: Lease) -> None:
        self.local.release_local(lease)

    def hold(self, tenant: str, lease_id: str) -> None:
        self.held.setdefault(tenant, set()).add(lease_id)

    def drop(self, tenant: str, lease_id: str) -> None:
        ids = self.held.get(tenant)
        if ids is not None:
            ids.discard(lease_id)
            if not ids:
                del self.held[tenant]

    async def refresh(self) -> None:
        """Extend every lease this gateway holds (call every ttl/3)."""
        for tenant, ids in list(self.held.items()):
            if not ids:
                continue
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._refresh(keys=[self.keys.leases(tenant)], args=[self.ttl_ms, *ids])
            except Exception as e:
                self._failed("refresh", e)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            await self.refresh()
