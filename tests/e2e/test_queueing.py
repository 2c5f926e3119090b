"""A busy node is not a dead one (issue 15, serving): a request queued on a backend that works through its queue
outlives the gateway's first_byte_timeout_s (the backend's keepalives restart the timer), and a backend whose
estimated queue wait is over --max-queue-wait-s refuses at once with 503 + Retry-After (error type "overloaded"),
which the gateway passes on without marking the node down.

Stub backends (tests/gateway/stub_backend.py) pin the gateway's side; real backend.server processes on the real
SmolLM2-135M model (tests/support/backend_process.py) behind the real gateway show it end to end. The hung-node case
(SIGSTOP: no keepalives, probes unanswered) is tests/e2e/test_node_faults.py.
"""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import requests

from tests.conftest import wait_until
from tests.gateway.conftest import DEMO_KEY, MODEL, client, parsed, tenant
from tests.support.backend_process import INTERNAL_AUTH, INTERNAL_SECRET, BackendProcess

MSGS = [{"role": "user", "content": "hi"}]
SEED = "queueing-test-seed"


def _post(gw, stream: bool, timeout: float = 30, **body) -> requests.Response:
    return requests.post(gw.url + "/v1/chat/completions", timeout=timeout, headers={"authorization": f"Bearer {DEMO_KEY}"},
                         json={"model": MODEL, "messages": MSGS, "max_tokens": 3, "stream": stream, **body})


def _content(r: requests.Response, stream: bool) -> str:
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    events = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


@pytest.mark.parametrize("stream", [False, True])
def test_keepalives_carry_a_request_past_the_first_byte_timeout(harness, stream):
    stub = harness.stub("queued")
    stub.behaviour.first_token_delay_s = 1.5
    stub.behaviour.keepalive_every_s = 0.1
    gw = harness.gateway([stub], first_byte_timeout_s=0.4)
    t0 = time.monotonic()
    r = _post(gw, stream)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 > 1.5
    assert _content(r, stream) == "The" and not stub.aborts


def test_without_keepalives_the_first_byte_timeout_still_fires(harness):
    """The stuck node (silent: no engine steps, no keepalives) is still timed out, keepalives or not elsewhere."""
    stub = harness.stub("stuck")
    stub.behaviour.first_token_delay_s = 3.0
    gw = harness.gateway([stub], first_byte_timeout_s=0.4)
    t0 = time.monotonic()
    r = _post(gw, False)
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text
    assert time.monotonic() - t0 < 2.0


def test_overloaded_node_is_skipped_not_marked_down(harness):
    busy, free = harness.stub("busy"), harness.stub("free")
    busy.behaviour.overloaded_retry_after = 7
    gw = harness.gateway([busy, free])
    for _ in range(4):
        r = _post(gw, False)
        assert r.status_code == 200, r.text
    assert len(free.requests) == 4
    retries = [ln for ln in requests.get(gw.url + "/metrics", timeout=5).text.splitlines()
               if ln.startswith("edgeinfer_gateway_upstream_retries_total{") and 'node="busy"' in ln]
    assert all(ln.endswith(" 0.0") for ln in retries), retries    # skipped, not counted as a failure
    # every node overloaded: 503 "overloaded" with the smallest Retry-After, no node marked down
    free.behaviour.overloaded_retry_after = 3
    t0 = time.monotonic()
    r = _post(gw, True)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "3", (r.headers, r.text)
    assert time.monotonic() - t0 < 2.0
    free.behaviour.overloaded_retry_after = 0
    assert _post(gw, False).status_code == 200    # at once: the refusal did not mark "free" down


# ---------------------------------------------------------------- real backend processes


@pytest.fixture(scope="module")
def model_dir():
    from edgeinfer.backend.model.gguf_import import ensure_default_model

    return ensure_default_model()


def _backend(model_dir, node_id: str, *args: str) -> BackendProcess:
    b = BackendProcess(model_dir, node_id, ["--max-num-seqs", "1", "--max-num-batched-tokens", "64",
                                            "--kv-cache-bytes", str(64 << 20), *args], SEED)
    try:
        b.wait_ready()
    except BaseException:
        b.stop()
        raise
    return b


def _gateway(harness, model_dir, backend: BackendProcess, **server):
    name = requests.get(backend.url + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()["model"]
    cfg = parsed({"server": {"page_seed": SEED, "health_interval_s": 0.5, "internal_secret": INTERNAL_SECRET,
                             **server},
                  "models": [{"name": name, "tokenizer": str(model_dir)}],
                  "nodes": [{"id": backend.node_id, "url": backend.url, "model": name}],
                  "tenants": [tenant()]})
    return harness.gateway([], cfg=cfg), name


def _generate(node: BackendProcess, rid: str, prompt: list[int], max_tokens: int) -> requests.Response:
    """A generate stream straight to the backend (held open; closing it aborts the request there)."""
    return requests.post(node.url + "/internal/generate", headers=INTERNAL_AUTH, stream=True, timeout=60,
                         json={"request_id": rid, "prompt_token_ids": prompt, "cache_namespace": "t",
                               "sampling": {"max_tokens": max_tokens, "ignore_eos": True}})


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_request_queued_behind_long_work_outlives_a_short_first_byte_timeout(harness, model_dir, stream):
    """One sequence slot, taken by a long generation for HOLD_S; a request through the gateway waits behind it
    while the gateway's first-byte timer is FIRST_BYTE_S < HOLD_S. Before keepalives it was a 503 after
    FIRST_BYTE_S on a healthy, working node. (The long one is ended by the test, so the wait does not depend
    on this machine's speed.)"""
    first_byte_s, hold_s = 6.0, 10.0
    node = _backend(model_dir, "queue-a", "--keepalive-s", "0.25")
    long = None
    try:
        gw, name = _gateway(harness, model_dir, node, first_byte_timeout_s=first_byte_s)
        c = client(gw).with_options(timeout=300)
        long = _generate(node, "long", [1, 504, 3458, 314], 100_000)
        assert long.status_code == 200
        assert wait_until(lambda: node.metric("edgeinfer_backend_requests_running") == 1, 60)
        out: list = []

        def queued() -> None:
            t0 = time.monotonic()
            try:
                if stream:
                    chunks = list(c.completions.create(model=name, prompt="The capital of France is", max_tokens=4,
                                                       temperature=0, stream=True))
                    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                else:
                    text = c.completions.create(model=name, prompt="The capital of France is", max_tokens=4,
                                                temperature=0).choices[0].text
                out.append((time.monotonic() - t0, text))
            except Exception as e:  # noqa: BLE001
                out.append((time.monotonic() - t0, f"ERROR {e!r}"))

        t = threading.Thread(target=queued)
        t.start()
        time.sleep(hold_s)
        assert not out, f"the queued request ended while the slot was still taken: {out}"
        long.close()                     # frees the slot (the backend aborts it)
        t.join(timeout=240)
        waited, text = out[0]
        assert text and not text.startswith("ERROR"), out
        assert waited > hold_s > first_byte_s
        print(f"\nqueued request ({'stream' if stream else 'non-stream'}) answered after {waited:.1f}s "
              f"(first_byte_timeout_s={first_byte_s:g})")
    finally:
        if long is not None:
            long.close()
        node.stop()


@pytest.mark.slow
def test_backend_refuses_a_request_its_queue_would_hold_too_long(harness, model_dir):
    node = _backend(model_dir, "queue-b", "--max-queue-wait-s", "1")
    held: list[requests.Response] = []
    try:
        gw, name = _gateway(harness, model_dir, node)
        c = client(gw).with_options(timeout=300)
        for i in range(6):   # ~6000 prompt tokens, admitted: no rate measured yet, so no estimate to refuse on
            held.append(_generate(node, f"backlog-{i}", list(range(2000 + i, 3000 + i)), 1))
            assert held[-1].status_code == 200, held[-1].text

        def estimate() -> float | None:
            return requests.get(node.url + "/ready", timeout=5).json()["queue_wait_s"]

        assert wait_until(lambda: estimate() is not None, 120)     # a few 64-token steps ran: the rate is known
        assert estimate() > 1.0, estimate()
        t0 = time.monotonic()
        direct = _generate(node, "one-more", list(range(5000, 5100)), 1)
        assert direct.status_code == 503, direct.text
        assert direct.json()["error"]["type"] == "overloaded" and int(direct.headers["retry-after"]) >= 1
        with pytest.raises(openai.APIStatusError) as e:
            client(gw).completions.create(model=name, prompt="hello", max_tokens=2)
        took = time.monotonic() - t0
        assert e.value.status_code == 503 and e.value.body["code"] == "overloaded", e.value.body
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert took < 5, f"the refusals took {took:.1f}s"
        assert node.metric("edgeinfer_backend_requests_overloaded_total") == 2
        for r in held:                   # closing the streams aborts the backlog
            r.close()
        held.clear()
        assert wait_until(lambda: node.metric("edgeinfer_backend_requests_waiting") == 0
                          and node.metric("edgeinfer_backend_requests_running") == 0, 60)
        assert c.completions.create(model=name, prompt="hello", max_tokens=2).choices[0].text is not None
    finally:
        for r in held:
            r.close()
        node.stop()
