"""One counter path for the page store (issue 18): StoreCounters.count moves BridgeStats and the Prometheus
series together; events without a series (errors, fetch requests) count only in the stats."""

from __future__ import annotations

from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.page_store.context import PAGE_EVENTS, StoreCounters


def _sample(m: BackendMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, {"model": "m", **labels}) or 0.0


def test_a_count_moves_the_stats_and_the_series_together():
    m = BackendMetrics("m")
    c = StoreCounters("m", m)
    for i, event in enumerate(PAGE_EVENTS, start=1):
        c.count(event, i)
        assert getattr(c.stats, event) == i == _sample(m, "edgeinfer_backend_page_store_pages_total", event=event)
    c.count("integrity_failures", source="redis")
    c.count("integrity_failures", 2, source="host")
    assert c.stats.integrity_failures == 3
    assert _sample(m, "edgeinfer_backend_integrity_failures_total", source="redis") == 1
    assert _sample(m, "edgeinfer_backend_integrity_failures_total", source="host") == 2
    c.count("errors")
    c.count("fetch_requests")
    assert (c.stats.errors, c.stats.fetch_requests) == (1, 1)
    assert _sample(m, "edgeinfer_backend_page_store_pages_total", event="errors") == 0
    c.fetch_took(0.02)
    assert _sample(m, "edgeinfer_backend_page_store_fetch_seconds_count") == 1


def test_without_metrics_only_the_stats_count():
    c = StoreCounters("m")
    c.count("uploaded", 5)
    c.count("integrity_failures", source="redis")
    c.fetch_took(1.0)
    assert (c.stats.uploaded, c.stats.integrity_failures) == (5, 1)
