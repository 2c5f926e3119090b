"""The tenant's fairness settings travel from the gateway config to the backend in GenerateRequest.tenant."""

from __future__ import annotations

import pytest
import requests

from edgeinfer.gateway import config as config_mod
from edgeinfer.protocol.wire import TenantSpec
from tests.gateway.conftest import MODEL, client, gateway_config, tenant


def test_tenant_spec_reaches_the_backend(harness):
    stub = harness.stub()
    gw = harness.gateway([stub], tenants=[tenant(weight=2.5, priority=3, retain=False, max_running_pages=40)])
    client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert stub.requests[0].tenant == TenantSpec("demo", 2.5, 3, False, 40)
    assert stub.requests[0].cache_namespace == "tenant:demo"


def test_tenant_spec_defaults(harness):
    stub = harness.stub()
    gw = harness.gateway([stub])
    client(gw).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert stub.requests[0].tenant == TenantSpec("demo", 1.0, 0, True, 0)


@pytest.mark.parametrize("field,value,match", [
    ("weight", 0, "weight=0"), ("weight", float("inf"), "weight=inf"), ("priority", 10, "priority=10"),
    ("priority", -1, "priority=-1"), ("max_running_pages", -3, "max_running_pages=-3")])
def test_bad_fairness_settings_are_config_errors(tokenizer_dir, field, value, match):
    data = gateway_config(tokenizer_dir, [], tenants=[tenant(**{field: value})])
    with pytest.raises(config_mod.ConfigError, match=f"tenant 'demo': {match}"):
        config_mod.parse(data)


@pytest.mark.parametrize("retain", [True, False])
def test_no_retain_tenant_prompts_are_not_indexed_by_the_gateway(harness, retain):
    """Single-node mode fills the prefix index at the gateway: never with a no-retain tenant's prompts."""
    a, b = harness.stub("node-a"), harness.stub("node-b")
    gw = harness.gateway([a, b], tenants=[tenant(retain=retain)])
    c = client(gw)
    for _ in range(3):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "same prompt " * 40}],
                                  max_tokens=2)
    m = requests.get(gw.url + "/metrics", timeout=5).text
    assert ('decision="prefix"' in m) == retain
