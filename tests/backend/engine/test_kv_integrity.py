"""KV integrity inside the engine (backend/engine/kv_integrity.py): each fault of tests/support/kv_faults.py is
caught, the request's output equals its clean run and the other requests' outputs are unaffected; the same fault
with the checks off (EngineConfig(kv_integrity=False)) changes an output, so each test would fail without them.
On a tiny random Llama (transformers' classes, safetensors), fp32 KV, driven step by step on the test's thread."""

from __future__ import annotations

import pytest

from edgeinfer.backend.engine.kv_integrity import PageLedger, body_checksums
from edgeinfer.backend.fault_injection import refuse_in_production
from edgeinfer.backend.model.loader import load_model
from edgeinfer.protocol.page_id import page_hashes
from tests.support.engine_steps import Stepper, engine, solo
from tests.support.kv_faults import ENV, KVFaults
from tests.support.tiny import prompt, tiny_llama

NEW = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(autouse=True)
def faults_on(monkeypatch):
    monkeypatch.setenv(ENV, "1")


@pytest.fixture(scope="module")
def clean(tiny):
    """Each test prompt served alone."""
    cache: dict[tuple, list[int]] = {}

    def get(ids: list[int], n: int = NEW) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            cache[key] = solo(tiny, ids, n)[0]
        return cache[key]
    return get


def failures(eng, where: str) -> int:
    return eng.blocks.ledger.failures[where]


# ------------------------------------------------------------------------------------------------ the four faults

def corrupted_page_run(tiny, checks: bool):
    """A's prompt is served and its pages sealed; one of them is overwritten in the pool; B (same prompt, another
    tenant of the same cache group) and C (another prompt) are then served together."""
    eng = engine(tiny, num_pages=40, kv_integrity=checks)
    s = Stepper(eng)
    p, q = prompt(1, 70), prompt(2, 50)
    s.add("a", p, NEW, tenant="x")
    s.run()
    h = page_hashes(eng.key_context("t"), p)[1]
    KVFaults(eng).corrupt_page(eng.blocks.cache[h].page)
    s.add("b", p, NEW, tenant="y")
    s.add("c", q, NEW, tenant="z")
    s.run()
    return eng, s, p, q


def test_corrupt_bytes_of_a_live_page_are_caught_at_reuse(tiny, clean):
    eng, s, p, q = corrupted_page_run(tiny, checks=True)
    assert failures(eng, "prefix_hit") == 1
    assert s.tokens["a"] == s.tokens["b"] == clean(p) and s.tokens["c"] == clean(q)
    assert s.seqs["b"].num_cached_prompt_tokens == 16        # page 0 reused, page 1 (corrupt) and on recomputed
    off, s_off, _, _ = corrupted_page_run(tiny, checks=False)
    assert s_off.tokens["b"] != clean(p) and s_off.tokens["c"] == clean(q)


def freed_live_page_run(tiny, checks: bool):
    """A and B decode; A's page being written is freed under it; C arrives and takes that page."""
    eng = engine(tiny, num_pages=40, kv_integrity=checks, enable_prefix_cache=False)
    s = Stepper(eng)
    p, q, r = prompt(3, 40), prompt(4, 33), prompt(5, 30)
    a = s.add("a", p, NEW)
    s.add("b", q, NEW)
    s.step(4)
    page = KVFaults(eng).free_live_page(a, len(a.block_table) - 1)
    c = s.add("c", r, NEW)
    try:
        s.step()
        assert page in c.block_table                          # the freed page went to the next allocation
        s.run()
    except RuntimeError as e:                                 # without the checks: A frees the page twice
        return eng, s, p, q, r, e
    return eng, s, p, q, r, None


def test_a_page_freed_while_its_sequence_decodes_is_caught_before_it_is_read(tiny, clean):
    eng, s, p, q, r, err = freed_live_page_run(tiny, checks=True)
    assert err is None and failures(eng, "step") >= 1
    assert (s.tokens["a"], s.tokens["b"], s.tokens["c"]) == (clean(p), clean(q), clean(r))
    assert eng.blocks.num_used == 0 and sorted(eng.blocks.free_uncached) == list(range(40))   # nothing leaked
    _, s_off, *_, err_off = freed_live_page_run(tiny, checks=False)
    assert err_off is not None or (s_off.tokens["a"], s_off.tokens["c"]) != (clean(p), clean(r))


def wrong_entry_run(tiny, checks: bool):
    """A and B decode; A's first table entry is pointed at B's first page."""
    eng = engine(tiny, num_pages=40, kv_integrity=checks, enable_prefix_cache=False)
    s = Stepper(eng)
    p, q = prompt(6, 45), prompt(7, 52)
    a = s.add("a", p, NEW)
    b = s.add("b", q, NEW)
    s.step(5)
    KVFaults(eng).point_entry(a, 0, b.block_table[0])
    try:
        s.run()
    except RuntimeError as e:              # without the checks: A gives B's page back as its own at the end
        return eng, s, p, q, e
    return eng, s, p, q, None


def test_a_block_table_entry_naming_another_sequences_page_is_caught(tiny, clean):
    eng, s, p, q, err = wrong_entry_run(tiny, checks=True)
    assert err is None and failures(eng, "step") == 1 and failures(eng, "free") == 0
    assert (s.tokens["a"], s.tokens["b"]) == (clean(p), clean(q))
    assert eng.blocks.num_used == 0 and sorted(eng.blocks.free_uncached) == list(range(40))   # A's lost page too
    _, s_off, _, _, err_off = wrong_entry_run(tiny, checks=False)
    assert s_off.tokens["a"] != clean(p) and (err_off is not None or s_off.tokens["b"] != clean(q))


def stale_entry_run(tiny, checks: bool):
    """A's pages are sealed; with stale entries kept, D's long prompt evicts and reuses them; B repeats A's
    prompt and finds A's entries still in the cache."""
    eng = engine(tiny, num_pages=14, kv_integrity=checks)
    KVFaults(eng).keep_stale_entries()
    s = Stepper(eng)
    p, d = prompt(8, 66), prompt(9, 180)
    s.add("a", p, 8)
    s.run()
    s.add("d", d, 8)
    s.run()
    s.add("b", p, NEW)
    try:
        s.run()
    except RuntimeError as e:              # without the checks: a stale page is given back twice
        return eng, s, p, d, e
    return eng, s, p, d, None


def test_a_prefix_entry_kept_after_its_page_was_reused_is_caught(tiny, clean):
    eng, s, p, d, err = stale_entry_run(tiny, checks=True)
    assert err is None and failures(eng, "prefix_hit") >= 1
    assert s.tokens["b"] == clean(p) and s.tokens["d"] == clean(d, 8)
    _, s_off, _, _, err_off = stale_entry_run(tiny, checks=False)
    assert err_off is not None or s_off.tokens["b"] != clean(p)


# ------------------------------------------------------------------------------------------------ the parts

def test_stamps_name_one_tenancy_of_one_page():
    ledger = PageLedger(4)
    a = ledger.take(2, owner=7)
    ledger.retire(2)
    b = ledger.take(2, owner=8)
    c = ledger.take(3, owner=8)
    assert len({a, b, c, int(ledger.stamp[2])}) == 3 and int(ledger.stamp[2]) == b
    assert int(ledger.owner[2]) == 8 and 0 not in (a, b, c)


def test_a_resumed_sequence_takes_back_only_its_own_sealed_pages(tiny, clean):
    """Preemption in a small pool: every resume re-checks the sealed pages it takes back (where="resume")."""
    eng = engine(tiny, num_pages=12, max_num_batched_tokens=32)
    s = Stepper(eng)
    ps = [prompt(20 + i, 40 + 7 * i) for i in range(4)]
    for i, p in enumerate(ps):
        s.add(f"r{i}", p, NEW)
    s.run()
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.ledger.checks["resume"] > 0
    assert sum(eng.blocks.ledger.failures.values()) == 0
    assert [s.tokens[f"r{i}"] for i in range(4)] == [clean(p) for p in ps]


def test_pool_checksums_are_the_page_bodies_checksums(tiny):
    """checksums() reads the pool in place; the same bytes gathered as page bodies hash the same (the page store
    receive check relies on it); a page written from a body that is not the body it was checked against fails."""
    eng = engine(tiny, num_pages=8, kv_dtype="fp8_e4m3")
    s = Stepper(eng)
    s.add("a", prompt(30, 50), 4)
    s.run()
    pages = [0, 1, 2, 3]
    body = eng.runner.page_io.read(pages)
    integ = eng.integrity
    assert integ.checksums(pages) == body_checksums(body)
    hashes = [bytes([i]) * 16 for i in range(4)]
    assert integ.received([4, 5, 6, 7], hashes, body, ["store_receive"] * 4) == 0   # pages 4..7 hold other bytes
    eng.runner.page_io.write([4, 5, 6, 7], body)
    assert integ.received([4, 5, 6, 7], hashes, body, ["swap_in"] * 4) == 4
    wrong = body.clone()
    wrong[2, 100] ^= 1
    eng.runner.page_io.write([4, 5, 6, 7], body)
    before = eng.blocks.ledger.failures["store_receive"]
    assert integ.received([4, 5, 6, 7], hashes, wrong, ["store_receive"] * 4) == 2
    assert eng.blocks.ledger.failures["store_receive"] == before + 1


def test_verify_fraction_zero_skips_the_content_check_only(tiny, clean):
    eng = engine(tiny, num_pages=40, kv_verify_fraction=0.0)
    s = Stepper(eng)
    p = prompt(1, 70)
    s.add("a", p, 4)
    s.run()
    h = page_hashes(eng.key_context("t"), p)[1]
    KVFaults(eng).corrupt_page(eng.blocks.cache[h].page)
    s.add("b", p, NEW)
    s.run()
    assert failures(eng, "prefix_hit") == 0 and eng.blocks.ledger.checks["prefix_hit"] > 0   # identity still checked
    assert s.tokens["b"] != clean(p)                                                      # the corrupt page was used


def test_bad_settings_and_production_refusal(monkeypatch):
    from edgeinfer.backend.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="kv_verify_fraction=1.5 is invalid"):
        EngineConfig(kv_verify_fraction=1.5)
    with pytest.raises(SystemExit, match="fault injection exists for the test suite only"):
        refuse_in_production()
    monkeypatch.delenv(ENV)
    refuse_in_production()
    with pytest.raises(RuntimeError, match="fault injection is off"):
        KVFaults(object())  # type: ignore[arg-type]


def test_metrics_count_checks_and_failures_by_where(tiny):
    from edgeinfer.backend.metrics import BackendMetrics

    eng, s, p, q = corrupted_page_run(tiny, checks=True)
    m = BackendMetrics("tiny")
    m.on_step(eng, None, 0.0)
    get = m.registry.get_sample_value
    assert get("edgeinfer_backend_kv_integrity_failures_total", {"model": "tiny", "where": "prefix_hit"}) == 1
    assert get("edgeinfer_backend_kv_integrity_checks_total", {"model": "tiny", "where": "step"}) > 0
    assert get("edgeinfer_backend_kv_integrity_checks_total", {"model": "tiny", "where": "free"}) > 0
