"""Prometheus metrics of one backend (own registry, so several engines can live in one test process)."""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from edgeinfer.backend.engine.engine import EngineObserver
from edgeinfer.backend.engine.page_ledger import WHERE

INTEGRITY_SOURCES = ("host", "redis", "peer")    # the tiers a fetched page comes from (page_store tiers, hand-off)

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class BackendMetrics(EngineObserver):
    """`registry`: the node's series (open on GET /metrics); `tenant_registry`: series labelled by tenant id."""

    def __init__(self, model: str) -> None:
        r = self.registry = CollectorRegistry()
        L = ["model"]
        self.model = model
        self.running = Gauge("edgeinfer_backend_requests_running", "Sequences in the running batch", L, registry=r)
        self.waiting = Gauge("edgeinfer_backend_requests_waiting", "Sequences waiting for admission", L, registry=r)
        self.pages_used = Gauge("edgeinfer_backend_kv_pages_used", "KV pages referenced by sequences", L, registry=r)
        self.pages_free = Gauge("edgeinfer_backend_kv_pages_free", "KV pages free (incl. reusable cached)", L,
                                registry=r)
        self.pages_total = Gauge("edgeinfer_backend_kv_pages_total", "KV pages in the pool", L, registry=r)
        # the autoscaling signal of one node (the gateway's edgeinfer_gateway_pool_* sum them per pool)
        self.prefill_queued = Gauge("edgeinfer_backend_prefill_tokens_queued",
                                    "Prompt tokens waiting to be prefilled (queued and unfinished chunks)", L, registry=r)
        self.kv_usage = Gauge("edgeinfer_backend_kv_usage_ratio", "KV pages referenced by sequences / pages", L,
                              registry=r)
        self.ttft_estimate = Gauge("edgeinfer_backend_ttft_estimate_seconds",
                                   "Estimated wait of a new request for its first token (the queued prefill over "
                                   "the measured rate; 0 before the first fit)", L, registry=r)
        self.hit_tokens = Counter("edgeinfer_backend_prefix_cache_hit_tokens", "Prompt tokens served from cache", L,
                                  registry=r)
        self.query_tokens = Counter("edgeinfer_backend_prefix_cache_query_tokens", "Prompt tokens looked up", L,
                                    registry=r)
        self.hit_rate = Gauge("edgeinfer_backend_prefix_cache_hit_rate", "hit tokens / query tokens", L, registry=r)
        self.ttft = Histogram("edgeinfer_backend_ttft_seconds", "Time to first token", L, buckets=_LAT, registry=r)
        self.itl = Histogram("edgeinfer_backend_inter_token_latency_seconds", "Inter-token latency", L,
                             buckets=_LAT, registry=r)
        self.preemptions = Counter("edgeinfer_backend_preemptions", "Sequences preempted (recompute)", L, registry=r)
        self.finished = Counter("edgeinfer_backend_requests_finished", "Finished requests", L + ["reason"], registry=r)
        self.overloaded = Counter("edgeinfer_backend_requests_overloaded",
                                  "Requests refused: estimated queue wait over --max-queue-wait-s", L, registry=r)
        self.prompt_tokens = Counter("edgeinfer_backend_prompt_tokens", "Prompt tokens", L, registry=r)
        self.gen_tokens = Counter("edgeinfer_backend_generation_tokens", "Generated tokens", L, registry=r)
        self.integrity_failures = Counter("edgeinfer_backend_integrity_failures",
                                          "KV pages dropped because their tag/header/tokens did not match",
                                          L + ["source"], registry=r)
        self.kv_checks = Counter("edgeinfer_backend_kv_integrity_checks",
                                 "Live KV pages checked (identity or checksum), by where: step, prefix_hit, resume, "
                                 "store_receive, swap_in, free", L + ["where"], registry=r)
        self.kv_failures = Counter("edgeinfer_backend_kv_integrity_failures",
                                   "Live KV pages that failed a check (dropped and recomputed), by where",
                                   L + ["where"], registry=r)
        self.weight_bytes = Gauge("edgeinfer_backend_weight_bytes", "Bytes of model weights", L, registry=r)
        self.prepacked_copy_bytes = Gauge("edgeinfer_backend_prepacked_copy_bytes",
                                          "Extra bytes of a prepacked CPU lm_head tied to the embedding", L,
                                          registry=r)
        self.kv_bytes_per_token = Gauge("edgeinfer_backend_kv_bytes_per_token", "KV bytes per token (+scales)", L,
                                        registry=r)
        self.max_kv_tokens = Gauge("edgeinfer_backend_kv_max_tokens", "Tokens that fit in the KV budget", L,
                                   registry=r)
        T = ["model", "tenant"]
        # tenant ids: shown on GET /metrics only to the gateway's secret or the operator key (backend/server.py)
        rt = self.tenant_registry = CollectorRegistry()
        self.tenant_served = Counter("edgeinfer_backend_tenant_served_tokens",
                                     "Tokens computed for a tenant (kind: prefill, decode; recompute included)",
                                     T + ["kind"], registry=rt)
        self.tenant_queue = Histogram("edgeinfer_backend_tenant_queue_seconds",
                                      "Arrival to first admission into the running batch", T, buckets=_LAT,
                                      registry=rt)
        self.tenant_cached_pages = Gauge("edgeinfer_backend_tenant_cached_pages",
                                         "Prefix-cache pages a tenant holds (in use or free)", T, registry=rt)
        self.tenant_counter = Gauge("edgeinfer_backend_tenant_virtual_tokens",
                                    "Fair scheduler's virtual token counter (weighted service / weight)", T,
                                    registry=rt)
        self.contended_steps = Counter("edgeinfer_backend_contended_steps",
                                       "Steps whose prefill the fair scheduler capped (> 1 tenant active)", L,
                                       registry=r)
        self.contended_cap = Gauge("edgeinfer_backend_contended_step_prefill_tokens",
                                   "Prefill-token cap of the last step with > 1 tenant active "
                                   "(the whole budget: nothing capped)", L, registry=r)
        self.step_cost = Gauge("edgeinfer_backend_step_cost_seconds",
                               "Fitted step time: fixed part, per decoding sequence, per prefill token", L + ["part"],
                               registry=r)
        self.spec_drafted = Counter("edgeinfer_backend_spec_drafted_tokens",
                                    "Speculative decoding: draft tokens verified", L, registry=r)
        self.spec_accepted = Counter("edgeinfer_backend_spec_accepted_tokens",
                                     "Speculative decoding: draft tokens accepted", L, registry=r)
        self.spec_acceptance = Gauge("edgeinfer_backend_spec_acceptance_rate",
                                     "Speculative decoding: accepted / drafted tokens since start", L, registry=r)
        self.fast_forwarded = Counter("edgeinfer_backend_grammar_fast_forward_tokens",
                                      "Tokens a grammar forced, emitted without a model step each", L, registry=r)
        for where in WHERE:     # known label values at 0 from the start: an alert works before the first failure
            self.kv_checks.labels(model, where)
            self.kv_failures.labels(model, where)
        for source in INTEGRITY_SOURCES:
            self.integrity_failures.labels(model, source)
        self._spec = (0, 0, 0)
        self._hits = 0
        self._queries = 0
        self._preempt = 0
        self._contended = 0
        self._holders: set[str] = set()
        self._kv_counted: dict[tuple[str, str], int] = {}

    def on_step(self, engine, batch, dt: float) -> None:
        m = self.model
        self.running.labels(m).set(engine.num_running)
        self.waiting.labels(m).set(engine.num_waiting)
        b = engine.blocks
        self.pages_used.labels(m).set(b.num_used)
        self.pages_free.labels(m).set(b.num_free)
        self.pages_total.labels(m).set(b.num_pages)
        self.prefill_queued.labels(m).set(engine.backlog.queued())
        self.kv_usage.labels(m).set(b.num_used / max(b.num_pages, 1))
        self.ttft_estimate.labels(m).set(engine.backlog.wait_s(0) or 0.0)
        if b.queries != self._queries:
            self.hit_tokens.labels(m).inc(b.hits - self._hits)
            self.query_tokens.labels(m).inc(b.queries - self._queries)
            self._hits, self._queries = b.hits, b.queries
            self.hit_rate.labels(m).set(b.hits / max(b.queries, 1))
        p = engine.scheduler.num_preemptions
        if p != self._preempt:
            self.preemptions.labels(m).inc(p - self._preempt)
            self._preempt = p
        sched = engine.scheduler
        c = getattr(sched, "num_contended_steps", 0)      # 0 on a FIFO (or an isolation probe's) scheduler
        if c > self._contended:
            self.contended_steps.labels(m).inc(c - self._contended)
            self._contended = c
        if getattr(sched, "contended_cap", 0):                 # also where it is the whole budget (none capped)
            self.contended_cap.labels(m).set(sched.contended_cap)
        self._kv_integrity(engine.blocks.ledger)
        self._speculative(engine)
        coef = engine.step_cost.coef
        if coef is not None:
            for part, v in zip(("fixed", "decode", "prefill_token"), coef):
                self.step_cost.labels(m, part).set(v)
        self._tenants(engine, batch)

    def _speculative(self, engine) -> None:
        st = engine.speculation.stats
        now = (st.drafted, st.accepted, engine.fast_forwarded)
        if now != self._spec:
            m = self.model
            for counter, a, b in zip((self.spec_drafted, self.spec_accepted, self.fast_forwarded), now, self._spec):
                if a > b:
                    counter.labels(m).inc(a - b)
            if now[0]:
                self.spec_acceptance.labels(m).set(now[1] / now[0])
            self._spec = now

    def _kv_integrity(self, ledger) -> None:
        for kind, counts, metric in (("checks", ledger.checks, self.kv_checks),
                                     ("failures", ledger.failures, self.kv_failures)):
            for where, n in list(counts.items()):
                seen = self._kv_counted.get((kind, where), 0)
                if n > seen:
                    metric.labels(self.model, where).inc(n - seen)
                    self._kv_counted[kind, where] = n

    def _tenants(self, engine, batch) -> None:
        m = self.model
        served: Tally[tuple[str, str]] = Tally()
        for s in batch.decodes if batch is not None else ():     # None: a refresh from GET /metrics
            served[s.tenant.id, "decode"] += 1
        for s, n in batch.prefills if batch is not None else ():
            served[s.tenant.id, "prefill"] += n
        for s, d in batch.verifies if batch is not None else ():     # a verify chunk: the last token and a draft
            served[s.tenant.id, "decode"] += 1 + len(d)
        for (t, kind), n in served.items():
            self.tenant_served.labels(m, t, kind).inc(n)
        held = {t or "(fetched, unused)": n for t, n in engine.blocks.held.items()}
        for t in self._holders - held.keys():
            self.tenant_cached_pages.labels(m, t).set(0)
        for t, n in held.items():
            self.tenant_cached_pages.labels(m, t).set(n)
        self._holders = set(held)
        for t, c in getattr(engine.scheduler, "counters", {}).items():
            self.tenant_counter.labels(m, t).set(c)

    def on_first_token(self, seq, ttft: float) -> None:
        self.ttft.labels(self.model).observe(ttft)
        if seq.admitted_at is not None:
            self.tenant_queue.labels(self.model, seq.tenant.id).observe(seq.admitted_at - seq.arrival)

    def on_token(self, seq, itl: float) -> None:
        self.itl.labels(self.model).observe(itl)

    def on_finish(self, seq) -> None:
        m = self.model
        self.finished.labels(m, seq.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(m).inc(len(seq.prompt_ids))
        self.gen_tokens.labels(m).inc(len(seq.output_ids))

    def set_memory(self, engine) -> None:
        m = self.model
        self.weight_bytes.labels(m).set(engine.model.weight_bytes())
        self.prepacked_copy_bytes.labels(m).set(engine.model.prepacked_copy_bytes())
        self.kv_bytes_per_token.labels(m).set(engine.runner.bytes_per_token)
        self.max_kv_tokens.labels(m).set(engine.blocks.num_pages * engine.cfg.page_size)
        self.pages_total.labels(m).set(engine.blocks.num_pages)
        self.pages_free.labels(m).set(engine.blocks.num_free)
        self.pages_used.labels(m).set(engine.blocks.num_used)

    def render(self, tenants: bool) -> bytes:
        """Prometheus text: the node's series, and the per-tenant ones when `tenants`."""
        body = generate_latest(self.registry)
        return body + generate_latest(self.tenant_registry) if tenants else body
