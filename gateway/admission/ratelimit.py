"""Per-tenant requests/min and tokens/min as GCRA (generic cell rate algorithm).

Each limit L per 60 s has an emission interval T = 60000/L ms and a burst tolerance of one window
(tau = 60000 ms): a request of cost c is admitted iff max(TAT, now) + c*T - now <= tau, and then
TAT advances by c*T. Admission runs before the prompt is tokenized: it charges the request and checks
the tokens budget at cost 0 (refused only while the tenant is in debt). The prompt's tokens are charged
once counted (`acquire(requests=False)`, checked: 429 if they do not fit; the request stays counted),
completion tokens after the response (`charge`, never rejected: it may push the tenant into debt so the
next request waits).

GCRA_LUA (lua.py) is the arithmetic as a Lua fragment: admit.py runs it in one script with the
concurrent-stream cap (atomic, Redis clock) so many gateways share one budget. LocalLimiter is the
same arithmetic in-process, for single-node mode and as the fallback when Redis fails.
"""

from __future__ import annotations

import logging
import math
import time
from typing import NamedTuple

from edgeinfer.gateway.config import TenantConfig

log = logging.getLogger(__name__)
WINDOW_MS = 60_000.0
# Tolerance of the window comparisons: tats are floats near the clock's value (ms since boot, ~3e7 after 9 h;
# epoch ms in Redis, stored to 1 us), so now + 30000 - now can be 30000.000000004, and without it the second of
# 2 requests per minute at the same instant was refused and one request held read as 0.9999999 of one.
EPS_MS = 0.01


class Decision(NamedTuple):
    allowed: bool
    retry_after_s: float
    limited_by: str                       # "requests" | "tokens" | ""
    remaining: dict[str, int]             # per limit name
    reset_s: dict[str, float]             # time until the limit is fully replenished

    def headers(self, tenant: TenantConfig) -> dict[str, str]:
        h: dict[str, str] = {}
        for name, limit in (("requests", tenant.requests_per_min), ("tokens", tenant.tokens_per_min)):
            if limit:
                h[f"x-ratelimit-limit-{name}"] = str(limit)
                h[f"x-ratelimit-remaining-{name}"] = str(max(0, self.remaining.get(name, 0)))
                h[f"x-ratelimit-reset-{name}"] = f"{self.reset_s.get(name, 0.0):.3f}s"
        if not self.allowed:
            h["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return h


UNLIMITED = Decision(True, 0.0, "", {}, {})


def limits_of(t: TenantConfig, tokens: int, requests: bool = True) -> list[tuple[str, float, int]]:
    out = []
    if requests and t.requests_per_min:
        out.append(("requests", WINDOW_MS / t.requests_per_min, 1))
    if t.tokens_per_min:
        out.append(("tokens", WINDOW_MS / t.tokens_per_min, tokens))
    return out


def gcra(tats: list[float], limits: list[tuple[str, float, int]], now: float, force: bool
         ) -> tuple[Decision, list[float]]:
    allowed, retry, by = True, 0.0, ""
    new_tats, remaining, reset = [], {}, {}
    for tat, (name, interval, cost) in zip(tats, limits, strict=True):
        tat = max(tat, now)
        new_tat = tat + cost * interval
        diff = new_tat - now
        if diff > WINDOW_MS + EPS_MS and not force:
            allowed = False
            if diff - WINDOW_MS > retry:
                retry, by = diff - WINDOW_MS, name
        new_tats.append(new_tat)
    for tat, new_tat, (name, interval, _) in zip(tats, new_tats, limits, strict=True):
        held = (new_tat if allowed else max(tat, now)) - now
        remaining[name] = math.floor((WINDOW_MS - held + EPS_MS) / interval)
        reset[name] = held / 1000.0
    return Decision(allowed, retry / 1000.0, by, remaining, reset), new_tats if allowed else tats


class LocalLimiter:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._tat: dict[tuple[str, str], float] = {}

    def acquire(self, tenant: TenantConfig, tokens: int, force: bool = False, requests: bool = True) -> Decision:
        """requests=False: the tokens limit alone (the prompt's tokens, charged after admission)."""
        limits = limits_of(tenant, tokens, requests)
        if not limits:
            return UNLIMITED
        now = self._clock() * 1000.0
        tats = [self._tat.get((tenant.id, name), now) for name, _, _ in limits]
        decision, new = gcra(tats, limits, now, force)
        for (name, _, _), tat in zip(limits, new, strict=True):
            self._tat[(tenant.id, name)] = tat
        if len(self._tat) > 100_000:
            self._tat = {k: v for k, v in self._tat.items() if v > now}
        return decision

    def charge(self, tenant: TenantConfig, tokens: int) -> None:
        """Completion tokens after the response: never rejected, may leave the tenant in debt."""
        if tenant.tokens_per_min and tokens > 0:
            now = self._clock() * 1000.0
            key = (tenant.id, "tokens")
            self._tat[key] = max(self._tat.get(key, now), now) + tokens * WINDOW_MS / tenant.tokens_per_min
