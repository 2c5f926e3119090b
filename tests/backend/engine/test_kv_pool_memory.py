"""The KV pool costs resident memory only for the pages requests used (issue 15, peak RSS): it was torch.zeros,
the whole budget (1 GiB by default then) resident from start-up."""

from __future__ import annotations

from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.model_runner import ModelRunner
from edgeinfer.backend.server import parse_args


def _rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_256_mib_kv_pool_is_not_resident_until_used(smol_model):
    before = _rss_mib()
    runner = ModelRunner(smol_model, EngineConfig(kv_cache_bytes=256 << 20))
    grew = _rss_mib() - before
    pool = sum(t.numel() * t.element_size() for kv in runner.kv for t in (kv.k, kv.v)) / (1 << 20)
    assert pool > 250
    assert grew < 32, f"building a {pool:.0f} MiB KV pool made {grew:.0f} MiB resident"
    assert all(float(t[::97].abs().sum()) == 0.0 for kv in runner.kv for t in (kv.k, kv.v))   # reads as zeros


def test_the_served_default_kv_budget_is_512_mib():
    assert parse_args(["--insecure-no-internal-auth"]).kv_cache_bytes == 512 << 20 == EngineConfig().kv_cache_bytes


def test_a_budget_under_one_page_is_refused_not_rounded_up(smol_model):
    """Issue 53, item 7: KV_CACHE_BYTES=-5 brought up a ready node with a one-page pool (max(1, ...)); the flag
    refuses a negative value, and a budget smaller than one page is an error naming it, not a silent page."""
    import pytest

    with pytest.raises(ValueError, match="--kv-cache-bytes 1000 holds no KV page"):
        ModelRunner(smol_model, EngineConfig(kv_cache_bytes=1000))
    assert ModelRunner(smol_model, EngineConfig(num_pages=3)).num_pages == 3
