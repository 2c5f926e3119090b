"""Prefill/decode disaggregation (issue 44) through the public API: real backend processes on SmolLM2 with --role
prefill / decode, the real gateway, the openai client.

- two hops give the same greedy tokens as a colocated node; the client sees one stream; the decode node received
  every full page of the prompt from the prefill node (which sent them) and computed only the tail; cached_tokens
  are the prefill side's hits;
- a short (or mostly cached) prompt skips the prefill hop;
- prefill node SIGKILLed mid-prefill: the request finishes on the decode node, which computes the prompt;
- decode node SIGKILLed before the first token: the request goes to another decode node, which pulls the pages;
- client gone mid-prefill: both pools return to idle (no page held, nothing running);
- prefill hop over its bound: counted as prefill_timeout, aborted on the prefill node, the request goes on;
- a decode node pulling from a stopped prefill node gives up after --handoff-timeout and computes;
- pages sealed under another page key are rejected one by one and recomputed, never served.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading

import pytest
import requests

from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.routing import affinity_node
from tests.conftest import wait_until
from tests.gateway.conftest import DEMO_KEY, OTHER_KEY, client, parsed, tenant
from tests.support.backend_process import INTERNAL_AUTH, INTERNAL_SECRET, BackendProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
SEED = "disagg-test-seed"
PAGE = 16
STORY = ("The lighthouse keeper counted the ships every evening and wrote their names in a green ledger. "
         "One winter a ship arrived that was not on any chart, its sails patched with old maps. ")


# each test's prompt starts differently, so no test finds another's pages cached
PROMPTS = {"two_hops": ("", 12), "short": ("Short. ", 1), "prefill_killed": ("Log 2. ", 40),
           "decode_killed": ("Log 3. ", 40), "timeout": ("Log 4. ", 40), "cancel": ("Log 5. ", 40)}


def prompt_text(key: str, tail: str = "") -> list[dict]:
    head, n = PROMPTS[key]
    return [{"role": "user", "content": head + STORY * n + tail + " Who sailed the ship? Answer briefly."}]


class Node(BackendProcess):
    def __init__(self, model_dir, node_id: str, role: str, log_dir, extra: list[str] | None = None) -> None:
        args = ["--max-num-seqs", "4", "--kv-cache-bytes", str(96 << 20), "--store-tier", "none", "--role", role,
                "--handoff-timeout", "2", *(extra or [])]
        super().__init__(model_dir, node_id, args, SEED, log_dir / f"{node_id}.log")
        self.role = role

    def load(self) -> dict:
        return requests.get(self.url + "/health", timeout=5).json()

    def idle(self) -> bool:
        h = self.load()
        return h["running"] == 0 and h["waiting"] == 0 and h["kv_pages_used"] == 0 and h["in_flight"] == 0

    def pages(self, direction: str) -> float:
        return self.metric("edgeinfer_backend_kv_handoff_pages_total", direction=direction)

    def computed(self) -> float:
        """Prompt tokens this node computed (not served from its prefix cache)."""
        return (self.metric("edgeinfer_backend_prompt_tokens_total")
                - self.metric("edgeinfer_backend_prefix_cache_hit_tokens_total"))


@pytest.fixture(scope="module")
def nodes(smol_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("disagg")
    key_file = log_dir / "other.key"
    key_file.write_text("another deployment's page key, 32+ chars long")
    made = {"p1": Node(smol_dir, "p1", "prefill", log_dir), "p2": Node(smol_dir, "p2", "prefill", log_dir)}
    peers = ["--handoff-peers", f"{made['p1'].url},{made['p2'].url}"]     # the prefill nodes a decode node trusts
    made |= {"d1": Node(smol_dir, "d1", "decode", log_dir, peers), "d2": Node(smol_dir, "d2", "decode", log_dir, peers),
             "other_key": Node(smol_dir, "other-key", "decode", log_dir, ["--page-key-file", str(key_file), *peers])}
    try:
        for n in made.values():
            n.wait_ready(timeout_s=240)
        yield made
    finally:
        for n in made.values():
            if n.proc.poll() is None:
                os.kill(n.proc.pid, signal.SIGCONT)
            n.stop()


def gateway(harness, smol_dir, members: list[Node], **server):
    name = requests.get(members[0].url + "/internal/info", headers=INTERNAL_AUTH, timeout=5).json()["model"]
    cfg = parsed({"server": {"page_seed": SEED, "health_interval_s": 0.25, "internal_secret": INTERNAL_SECRET,
                             "disagg_min_prefill_tokens": 64, **server},
                  "models": [{"name": name, "tokenizer": str(smol_dir)}],
                  "nodes": [{"id": n.node_id, "url": n.url, "model": name} for n in members],
                  "tenants": [tenant(), tenant(id="ref", api_key_sha256=[config_mod.hash_key(OTHER_KEY)])]})
    return harness.gateway([], cfg=cfg), name


def outcomes(gw) -> dict[str, float]:
    text = requests.get(gw.url + "/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^edgeinfer_gateway_disaggregated_requests_total\{model="[^"]+",outcome="(\w+)"\} (\S+)$',
                        text, re.M)}


def ask(gw, name: str, messages, max_tokens: int = 12, key: str = DEMO_KEY, **kw):
    return client(gw, key).with_options(timeout=120).chat.completions.create(model=name, messages=messages, max_tokens=max_tokens,
                                                                temperature=0, **kw)


def when_running(node: Node, timeout_s: float = 60) -> None:
    wait_until(lambda: node.load()["running"] + node.load()["waiting"] > 0, timeout_s, 0.01,
               what=f"a request running on {node.node_id}")


@pytest.fixture(scope="module")
def reference(harness_module, smol_dir, nodes):
    """Greedy answers of a colocated deployment (d2 alone: a decode node prefills what it is sent), asked by
    another tenant (its own cache namespace: no test's prompt is cached on d2 by this)."""
    gw, name = gateway(harness_module, smol_dir, [nodes["d2"]])
    return {k: ask(gw, name, prompt_text(k), key=OTHER_KEY).choices[0].message.content
            for k in PROMPTS if k != "cancel"}


@pytest.fixture(scope="module")
def harness_module(tokenizer, tokenizer_dir):
    from tests.gateway.conftest import Harness

    h = Harness(tokenizer, tokenizer_dir)
    yield h
    h.close()


def test_two_hops_give_the_colocated_tokens_and_hand_every_full_page_over(harness, smol_dir, nodes, reference):
    p1, d1 = nodes["p1"], nodes["d1"]
    gw, name = gateway(harness, smol_dir, [p1, d1], disagg_min_prefill_tokens=0)
    sent, got, computed = p1.pages("sent"), d1.pages("received"), d1.computed()
    r = ask(gw, name, prompt_text("two_hops"))
    assert r.choices[0].message.content == reference["two_hops"]
    n = r.usage.prompt_tokens
    full = (n - 1) // PAGE
    assert p1.pages("sent") - sent == full and d1.pages("received") - got == full
    assert d1.computed() - computed == n - full * PAGE      # the decode node computed the tail alone
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached on the prefill side yet
    assert outcomes(gw) == {"handed_off": 1}
    # streamed: one stream; a prompt sharing the first's pages (min prefill tokens 0: it takes both hops too)
    stream = client(gw).with_options(timeout=120).chat.completions.create(
        model=name, messages=prompt_text("two_hops", " Again."), max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens >= 1 and "".join(c.choices[0].delta.content or ""
                                                               for c in chunks if c.choices)
    # the prefill side's hits are what the client is told
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= full * PAGE - 2 * PAGE
    assert outcomes(gw) == {"handed_off": 2}
    assert wait_until(lambda: p1.idle() and d1.idle(), 10)


def test_short_or_cached_prompt_skips_the_prefill_hop(harness, smol_dir, nodes, reference):
    p1, d1 = nodes["p1"], nodes["d1"]
    gw, name = gateway(harness, smol_dir, [p1, d1], disagg_min_prefill_tokens=200)
    before = p1.computed()
    r = ask(gw, name, prompt_text("short"))       # ~60 tokens
    assert r.choices[0].message.content == reference["short"]
    assert p1.computed() == before and outcomes(gw) == {"skipped_short": 1}


def test_prefill_node_killed_mid_prefill_the_decode_node_computes(harness, smol_dir, nodes, reference, tmp_path):
    p2, d1 = nodes["p2"], nodes["d1"]
    gw, name = gateway(harness, smol_dir, [p2, d1])
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=ask(gw, name, prompt_text("prefill_killed"))))
    t.start()
    when_running(p2)
    os.kill(p2.proc.pid, signal.SIGKILL)
    t.join(timeout=120)
    assert not t.is_alive(), "the request hung after its prefill node died"
    assert result["r"].choices[0].message.content == reference["prefill_killed"]
    assert outcomes(gw) == {"prefill_failed": 1}
    p2.proc.wait()
    nodes["p2"] = Node(smol_dir, "p2", "prefill", tmp_path)     # later tests get a live p2
    nodes["p2"].wait_ready(240)


def test_decode_node_killed_before_its_first_token_another_takes_the_request(harness, smol_dir, nodes, reference,
                                                                             tmp_path):
    p1, d1, d2 = nodes["p1"], nodes["d1"], nodes["d2"]
    gw, name = gateway(harness, smol_dir, [p1, d1, d2], route_affinity_tokens=100_000)

    class _N:
        def __init__(self, node_id: str) -> None:
            self.node_id = node_id

    session = next(f"s{i}" for i in range(1000) if affinity_node(f"s{i}", [_N("d1"), _N("d2")]).node_id == "d2")
    got = d1.pages("received")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        r=ask(gw, name, prompt_text("decode_killed"), extra_headers={"x-session-affinity": session})))
    t.start()
    when_running(p1)        # the decode node was chosen (d2, by affinity) before the prefill hop began
    os.kill(d2.proc.pid, signal.SIGKILL)
    t.join(timeout=120)
    assert not t.is_alive()
    assert result["r"].choices[0].message.content == reference["decode_killed"]
    assert d1.pages("received") > got                   # d1 pulled the pages from p1
    assert outcomes(gw) == {"handed_off": 1}
    d2.proc.wait()
    nodes["d2"] = Node(smol_dir, "d2", "decode", tmp_path)
    nodes["d2"].wait_ready(240)


def test_client_gone_mid_prefill_leaves_both_pools_idle(harness, smol_dir, nodes):
    p1, d1 = nodes["p1"], nodes["d1"]
    gw, name = gateway(harness, smol_dir, [p1, d1])
    body = json.dumps({"model": name, "messages": prompt_text("cancel"), "max_tokens": 50,
                       "stream": True})
    host, port = gw.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"authorization": f"Bearer {DEMO_KEY}", "content-type": "application/json"})
    aborted = p1.metric("edgeinfer_backend_requests_finished_total", reason="abort")
    when_running(p1)
    conn.close()       # the client leaves mid-prefill: the gateway aborts the hop on the prefill node
    wait_until(lambda: p1.idle() and d1.idle(), 20, what="both pools idle after the client left")
    assert p1.metric("edgeinfer_backend_requests_finished_total", reason="abort") == aborted + 1


def test_a_prefill_hop_over_its_bound_fails_and_the_request_goes_on(harness, smol_dir, nodes, reference):
    p1, d1 = nodes["p1"], nodes["d1"]
    gw, name = gateway(harness, smol_dir, [p1, d1], disagg_prefill_timeout_s=0.3)
    r = ask(gw, name, prompt_text("timeout"))       # ~2,000 tokens: far more than 0.3 s to prefill here
    assert r.choices[0].message.content == reference["timeout"]
    assert outcomes(gw) == {"prefill_timeout": 1}
    wait_until(lambda: p1.idle(), 20, what="the timed-out prefill aborted on the prefill node")


def _generate(node: Node, prompt: list[int], namespace: str, **extra):
    return node.generate(prompt, namespace, 8, **extra)


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_prefill_only_answers_one_chunk_without_a_token(nodes):
    ids, last = _generate(nodes["p1"], _prompt(1, 300), "ns-prefill-only", prefill_only=True)
    assert ids == [] and last.finish_reason == "prefilled" and last.usage.prompt_tokens == 300


def test_pages_sealed_under_another_key_are_rejected_and_recomputed(nodes):
    p1, other = nodes["p1"], nodes["other_key"]
    prompt = _prompt(2, 400)
    cold, _ = _generate(other, prompt, "ns-cold")          # the same tokens computed without any hand-off
    _generate(p1, prompt, "ns-key", prefill_only=True)
    rejected = other.pages("rejected")
    ids, last = _generate(other, prompt, "ns-key", kv_source={"node_id": "p1", "url": p1.url})
    assert ids == cold
    assert other.pages("rejected") - rejected == 1        # the first page fails its MAC: the pull stops there
    assert other.metric("edgeinfer_backend_integrity_failures_total", source="peer") >= 1
    assert last.usage.cached_tokens == 0


def test_a_stopped_prefill_node_costs_the_decode_node_its_handoff_timeout_at_most(nodes):
    p1, d1 = nodes["p1"], nodes["d1"]
    prompt = _prompt(3, 300)
    _generate(p1, prompt, "ns-stop", prefill_only=True)
    timeouts = d1.metric("edgeinfer_backend_kv_handoff_pulls_total", outcome="timeout")
    os.kill(p1.proc.pid, signal.SIGSTOP)
    try:
        ids, last = _generate(d1, prompt, "ns-stop", kv_source={"node_id": "p1", "url": p1.url})
    finally:
        os.kill(p1.proc.pid, signal.SIGCONT)
    assert len(ids) == 8 and last.finish_reason == "length"
    # the pull ended by its --handoff-timeout (counted as such), not by the stopped node answering or by hanging
    assert d1.metric("edgeinfer_backend_kv_handoff_pulls_total", outcome="timeout") == timeouts + 1
