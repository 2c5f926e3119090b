"""Issue 53: what a broken or hostile node sends the gateway is bounded and checked. The node is the attacker here
(tests/gateway/stub_backend.py over real HTTP); the gateway under test is the real app, asked with the openai client.

- a node's unterminated line is not buffered past the line cap: the hop fails, the gateway's memory does not follow
  the node's bytes (a 256 MB line raised its peak RSS by 243 MiB before), and the node's writes stall (back-pressure);
- a node's usage claims are held to what the gateway knows (prompt = the ids sent, cached <= prompt, completion <=
  max_tokens), corrected and counted;
- the metrics and admin keys count only as `Bearer <key>`.
"""

from __future__ import annotations

import re
import resource

import openai
import pytest
import requests

from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.http1 import MAX_LINE
from tests.gateway.conftest import METRICS_KEY, client
from tests.gateway.stub_backend import StubBehaviour


def _corrected(gw, field: str) -> float:
    text = requests.get(gw.url + "/metrics", timeout=5).text
    m = re.search(rf'^edgeinfer_gateway_node_usage_corrected_total\{{field="{field}",model="[^"]+"\}} (\S+)$', text,
                  re.M)
    return float(m.group(1)) if m else 0.0


def test_an_unterminated_line_from_a_node_is_bounded(harness):
    node = harness.stub(behaviour=StubBehaviour(endless_line_bytes=256 << 20))
    gw = harness.gateway([node])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert e.value.status_code >= 500
    assert grew_mib < 96, f"peak RSS grew {grew_mib:.0f} MiB while the node sent a line of 256 MiB"
    assert node.sent_bytes < 256 << 20          # the node could not push it all: reading paused, then closed
    assert node.sent_bytes >= MAX_LINE


def test_a_nodes_usage_claims_are_held_to_what_the_gateway_knows(harness):
    node = harness.stub(behaviour=StubBehaviour(usage_claim=(5, 10_000, 999_999)))
    gw = harness.gateway([node])
    messages = [{"role": "user", "content": "Count the sheep in the field, please."}]
    r = client(gw).chat.completions.create(model="stub-model", messages=messages, max_tokens=6)
    sent = node.requests[-1]
    u = r.usage
    assert u.prompt_tokens == len(sent.prompt_token_ids)         # the ids the gateway sent, not the node's 5
    assert u.prompt_tokens_details.cached_tokens <= u.prompt_tokens
    assert u.completion_tokens <= 6
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    for field in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert _corrected(gw, field) >= 1, field
    stream = client(gw).chat.completions.create(model="stub-model", messages=messages, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens <= last.usage.prompt_tokens
    assert last.usage.completion_tokens <= 6


def test_honest_usage_is_not_corrected(harness):
    gw = harness.gateway([harness.stub()])
    client(gw).chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert all(_corrected(gw, f) == 0 for f in ("prompt_tokens", "completion_tokens", "cached_tokens"))


def test_metrics_and_admin_keys_count_only_as_bearer(harness):
    admin = "sk-test-admin-key-0123456789"
    gw = harness.gateway([harness.stub()], admin_key_sha256=config_mod.hash_key(admin))
    for key in (METRICS_KEY, admin):
        assert requests.get(gw.url + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=5).status_code \
            == 200
        for scheme in ("Basic", "Token", "bearer-ish"):
            r = requests.get(gw.url + "/metrics", headers={"authorization": f"{scheme} {key}"}, timeout=5)
            assert r.status_code == 401, scheme
    r = requests.post(gw.url + "/admin/reload", headers={"authorization": f"Basic {admin}"}, timeout=5)
    assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
