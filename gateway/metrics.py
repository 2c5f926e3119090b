"""Prometheus metrics, one pair of registries per app (tests run several apps in one process).

`registry` holds the series without tenant ids: GET /metrics shows them to anyone who reaches the port.
`tenant_registry` holds every series labelled by tenant: shown only with the metrics or admin key
(server.metrics_key_sha256, server.admin_key_sha256), so no tenant learns another's ids or traffic."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class TenantModelSeries(NamedTuple):
    """Children of the per-(tenant, model) series, resolved once (labels() costs a few us per call)."""

    prompt_tokens: Counter
    completion_tokens: Counter
    cached_tokens: Counter
    ttft: Histogram
    itl: Histogram
    aborts: Counter


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        t = self.tenant_registry = CollectorRegistry()
        p = "edgeinfer_gateway_"
        self.requests = Counter(p + "requests_total", "HTTP requests by outcome",
                                ["tenant", "model", "endpoint", "status"], registry=t)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "prompt tokens", ["tenant", "model"], registry=t)
        self.completion_tokens = Counter(p + "completion_tokens_total", "generated tokens",
                                         ["tenant", "model"], registry=t)
        self.cached_tokens = Counter(p + "cached_tokens_total", "prompt tokens served from the prefix cache",
                                     ["tenant", "model"], registry=t)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "request arrival to first token",
                              ["tenant", "model"], buckets=_LATENCY, registry=t)
        self.itl = Histogram(p + "inter_token_latency_seconds", "gap between streamed token chunks",
                             ["tenant", "model"], buckets=_ITL, registry=t)
        self.duration = Histogram(p + "request_duration_seconds", "request arrival to last byte",
                                  ["tenant", "model", "endpoint"], buckets=_LATENCY, registry=t)
        self.rate_limited = Counter(p + "rate_limit_rejections_total", "429s by limit",
                                    ["tenant", "limit"], registry=t)
        self.routing = Counter(p + "routing_decisions_total", "node choice: prefix hit, affinity or load fallback",
                               ["model", "decision"], registry=r)
        self.disaggregated = Counter(p + "disaggregated_requests_total",
                                     "runs of a pool with prefill nodes, by what their prefill hop did: handed_off, "
                                     "skipped_short, skipped_no_retain, prefill_failed, prefill_timeout",
                                     ["model", "outcome"], registry=r)
        self.retries = Counter(p + "upstream_retries_total", "node failed before the first byte; tried another",
                               ["model", "node"], registry=r)
        self.aborts = Counter(p + "client_aborts_total", "client went away; backend request aborted",
                              ["tenant", "model"], registry=t)
        self.inflight = Gauge(p + "inflight_requests", "requests being served", registry=r)
        self.usage_corrected = Counter(p + "node_usage_corrected_total",
                                       "usage claims of a node outside what the gateway knows (prompt tokens other "
                                       "than sent, cached over the prompt, completion over max_tokens), corrected",
                                       ["model", "field"], registry=r)
        self.node_records_refused = Counter(p + "node_records_refused_total",
                                            "registry node records not believed (unsigned, bad signature, expired)",
                                            ["reason"], registry=r)
        self.limiter_fallbacks = Gauge(p + "ratelimit_redis_failures", "Redis limiter calls that fell back",
                                       registry=r)

        pool = ["model", "role"]
        self.pool_nodes = Gauge(p + "pool_nodes", "routable backends per model and role (the autoscaling pool)", pool,
                                registry=r)
        self.pool_prefill_queued = Gauge(p + "pool_prefill_tokens_queued",
                                         "prompt tokens waiting to be prefilled on the pool's nodes (sum)", pool,
                                         registry=r)
        self.pool_kv_usage = Gauge(p + "pool_kv_usage_ratio", "KV pages in use / pages, mean over the pool's nodes",
                                   pool, registry=r)
        self.pool_ttft = Gauge(p + "pool_ttft_estimate_seconds",
                               "estimated wait for a new request's first token, mean over the pool's nodes", pool,
                               registry=r)
        self.pool_load = Gauge(p + "pool_load_ratio",
                               "max(kv usage / autoscale_kv_target, ttft estimate / autoscale_ttft_target_s) over "
                               "the pool: the HPA's target is 1 (docs/OPERATIONS.md)", pool, registry=r)
        self._series: dict[tuple[str, str], TenantModelSeries] = {}
        self._pools: set[tuple[str, str]] = set()

    def usage_clamp(self, model: str) -> Callable[[str], None]:
        """Counts a corrected usage claim of a node (gateway/generation.checked_usage) by field."""
        return lambda field: self.usage_corrected.labels(model, field).inc()

    def series(self, tenant: str, model: str) -> TenantModelSeries:
        s = self._series.get((tenant, model))
        if s is None:
            s = self._series[(tenant, model)] = TenantModelSeries(
                self.prompt_tokens.labels(tenant, model), self.completion_tokens.labels(tenant, model),
                self.cached_tokens.labels(tenant, model), self.ttft.labels(tenant, model),
                self.itl.labels(tenant, model), self.aborts.labels(tenant, model))
        return s

    def set_pools(self, nodes, kv_target: float, ttft_target_s: float) -> None:
        """The autoscaling gauges from the routable nodes (gateway.nodes.Node), per (model, role); a pool that lost
        its last node reads 0 nodes."""
        pools: dict[tuple[str, str], list] = {}
        for n in nodes:
            pools.setdefault((n.model, n.role), []).append(n)
        for key in list(self._pools - set(pools)):
            self.pool_nodes.labels(*key).set(0)
        for key, ns in pools.items():
            kv = sum(n.kv_usage for n in ns) / len(ns)
            ttft = sum(n.ttft_estimate_s for n in ns) / len(ns)
            self.pool_nodes.labels(*key).set(len(ns))
            self.pool_prefill_queued.labels(*key).set(sum(n.prefill_queued for n in ns))
            self.pool_kv_usage.labels(*key).set(kv)
            self.pool_ttft.labels(*key).set(ttft)
            self.pool_load.labels(*key).set(max(kv / kv_target, ttft / ttft_target_s))
        self._pools = set(pools) | self._pools

    def render(self, tenants: bool) -> bytes:
        body = generate_latest(self.registry)
        return body + generate_latest(self.tenant_registry) if tenants else body
