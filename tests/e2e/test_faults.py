"""Faults: a slow backend (the gateway's first-byte and chunk timeouts fire: a clean error, no hang, the
backend request aborted), Redis killed under a gateway mid-load (it keeps answering; the shared limiter
resumes), pages corrupted in Redis while several requests fetch them concurrently (none served, outputs
identical to cold).

Covered elsewhere, not duplicated here (see docs/RELIABILITY.md):
- Redis killed mid-load under two backend processes, caching resumes: tests/backend/page_store/test_bridge.py
- a backend SIGKILLed mid-stream (SSE error event + [DONE], rerouting within one heartbeat): tests/ops/test_rollout.py
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import openai
import pytest
import requests

from edgeinfer.cache_store.codec import DecodedPage, decode
from edgeinfer.protocol.page_id import page_hashes
from tests.conftest import wait_until
from tests.e2e.test_isolation import rand_prompt, run, two_nodes  # noqa: F401  (module fixture)
from tests.gateway.conftest import MODEL, client, tenant

MSGS = [{"role": "user", "content": "hi"}]


def _slow_gateway(harness, n_stubs: int, delay_s: float, **server):
    stubs = [harness.stub(f"slow-{i}") for i in range(n_stubs)]
    for s in stubs:
        s.behaviour.token_delay_s = delay_s
    return stubs, harness.gateway(stubs, **server)


@pytest.mark.parametrize("stream", [False, True])
def test_first_byte_timeout_fires_on_every_node_then_503(harness, stream):
    stubs, gw = _slow_gateway(harness, 2, delay_s=5.0, first_byte_timeout_s=0.3, max_attempts=3)
    t0 = time.monotonic()
    r = requests.post(gw.url + "/v1/chat/completions", timeout=30, headers={"authorization": "Bearer sk-edgeinfer-demo"},
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 3, "stream": stream})
    dt = time.monotonic() - t0
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text
    assert "TimeoutError" in r.json()["error"]["message"]
    assert dt < 2.0, f"took {dt:.2f}s for two 0.3 s timeouts"
    assert sorted(len(s.requests) for s in stubs) == [1, 1]          # each node tried once, no hang on either
    assert wait_until(lambda: all(len(s.aborts) == 1 for s in stubs), 5), [s.aborts for s in stubs]


def test_chunk_timeout_ends_a_started_stream_with_an_error_event(harness):
    stubs, gw = _slow_gateway(harness, 1, delay_s=1.0, first_byte_timeout_s=5, chunk_timeout_s=0.3)
    t0 = time.monotonic()
    r = requests.post(gw.url + "/v1/chat/completions", timeout=30, headers={"authorization": "Bearer sk-edgeinfer-demo"},
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 5, "stream": True})
    dt = time.monotonic() - t0
    assert r.status_code == 200
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "upstream_failed" and "TimeoutError" in err["message"], err
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "T"        # the first token got through
    assert dt < 2.5, dt
    assert wait_until(lambda: stubs[0].aborts == [stubs[0].requests[0].request_id], 5)
    # the openai client raises instead of hanging or returning a silently truncated answer
    with pytest.raises(openai.APIError):
        list(client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, stream=True))


def test_chunk_timeout_non_streaming_is_502(harness):
    stubs, gw = _slow_gateway(harness, 1, delay_s=1.0, first_byte_timeout_s=5, chunk_timeout_s=0.3)
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)
    assert e.value.status_code == 502 and e.value.body["code"] == "upstream_failed"
    assert wait_until(lambda: len(stubs[0].aborts) == 1, 5)


def test_gateway_keeps_answering_with_redis_killed_mid_load_and_limiter_resumes(harness, valkey):
    import redis

    r = redis.Redis.from_url(valkey.url)
    r.flushall()
    stubs = [harness.stub("ra"), harness.stub("rb")]
    gw = harness.gateway(stubs, tenants=[tenant(requests_per_min=100_000)], redis_url=valkey.url,
                         index_fill="backends")
    results: list[tuple[float, str]] = []
    stop = threading.Event()

    def load() -> None:
        c = client(gw)
        while not stop.is_set():
            t = time.monotonic()
            try:
                out = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
                results.append((time.monotonic() - t, out.choices[0].message.content))
            except Exception as e:  # noqa: BLE001
                results.append((time.monotonic() - t, f"ERROR {e!r}"))

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        assert wait_until(lambda: len(results) >= 10, 20)
        # the first Redis calls (connect + script load) may exceed the limiter's 250 ms and fall back
        assert wait_until(lambda: r.exists("ei:rl:{demo}:requests") == 1, 15), "limiter never used Redis"
        valkey.kill()
        n_down = len(results)
        assert wait_until(lambda: len(results) >= n_down + 30, 30), "gateway stopped answering with Redis down"
        valkey.start()                                    # same port, empty
        r = redis.Redis.from_url(valkey.url)
        assert wait_until(lambda: r.exists("ei:rl:{demo}:requests") == 1, 20), "limiter did not go back to Redis"
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
    errors = [x for _, x in results if x.startswith("ERROR")]
    assert not errors and all(x == "The" for _, x in results), errors[:3]
    assert max(dt for dt, _ in results) < 3.0, max(dt for dt, _ in results)
    m = requests.get(gw.url + "/metrics", timeout=5).text
    assert "edgeinfer_gateway_ratelimit_redis_failures" in m


async def _gather(coros):
    return await asyncio.gather(*coros)


@pytest.mark.slow
def test_pages_corrupted_in_redis_under_concurrent_fetches_are_never_served(two_nodes):  # noqa: F811
    """A serves 6 prompts (pages published to Redis); 8 of each prompt's 10 pages are then bit-flipped in
    Redis; B serves all 6 concurrently: each gets exactly the 2 intact leading pages from the store, detects the
    first corrupt one, recomputes the rest, and answers exactly what A computed cold."""
    loop, [(ea, ba, store, _), (eb, bb, _, mb)] = two_nodes
    ns = "tenant:corrupt"
    prompts = [rand_prompt(500 + i, 161) for i in range(6)]
    refs = loop.run_until_complete(_gather(run(ea, p, ns, max_tokens=6, bridge=ba) for p in prompts))
    assert all(u.cached_tokens == 0 for _, u, _ in refs)
    assert loop.run_until_complete(ba.flush(30))
    rng = random.Random(3)
    client_ = bb.redis_client
    corrupted = 0
    for p in prompts:
        hashes = page_hashes(ea.key_context(ns), p)
        assert len(hashes) == 10
        blobs = loop.run_until_complete(store.get_many(hashes))
        for h, blob in list(zip(hashes, blobs, strict=True))[2:]:
            bad = bytearray(blob)
            for bit in rng.sample(range(len(bad) * 8), rng.randint(1, 4)):
                bad[bit // 8] ^= 1 << (bit % 8)
            loop.run_until_complete(client_.set(store.keys.page(h), bytes(bad), keepttl=True))
            corrupted += 1
    failures = lambda: mb.registry.get_sample_value(  # noqa: E731
        "edgeinfer_backend_integrity_failures_total", {"model": "smol", "source": "redis"}) or 0.0
    before = failures()
    outs = loop.run_until_complete(_gather(run(eb, p, ns, max_tokens=6, bridge=bb) for p in prompts))
    for (ref, _, _), (out, u, _) in zip(refs, outs, strict=True):
        assert u.cached_tokens == 32, u                  # pages 0-1 from the store, nothing past the corruption
        assert out == ref
    assert failures() == before + len(prompts)           # one detection per fetch (it stops at the first)
    # the corrupt copies were deleted; what is in Redis now is B's own recomputed pages (republished), all valid
    assert loop.run_until_complete(bb.flush(30))
    for p in prompts:
        hashes = page_hashes(ea.key_context(ns), p)
        for i, blob in enumerate(loop.run_until_complete(store.get_many(hashes))):
            expect = bb.format.expect(hashes[i], hashes[i - 1] if i else ea.key_context(ns).root,
                                      p[16 * i:16 * (i + 1)])
            assert blob is None or isinstance(decode(blob, expect, bb.page_key), DecodedPage), f"page {i} still corrupt"
    assert corrupted == 48
