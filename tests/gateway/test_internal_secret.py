"""The gateway proves itself to backends: `authorization: Bearer <internal secret>` on /internal/info (node
probes), /internal/generate and /internal/abort; from server.internal_secret or its env variable."""

from __future__ import annotations

import openai
import pytest
import requests

from edgeinfer.gateway import config as config_mod
from tests.conftest import wait_until
from tests.gateway.conftest import MODEL, client, gateway_config

SECRET = "gateway-to-backend-secret-42"
MSGS = [{"role": "user", "content": "Hello there"}]


def _paths(stub, auth: str | None) -> set[str]:
    return {path for path, got in stub.auth_seen if got == auth}


def test_gateway_sends_the_secret_on_info_generate_and_abort(harness):
    stub = harness.stub(secret=SECRET)
    stub.behaviour.token_delay_s = 0.02
    gw = harness.gateway([stub], internal_secret=SECRET)
    r = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
    assert r.choices[0].message.content
    stream = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=500, stream=True)
    it = iter(stream)
    next(it), next(it)
    stream.close()                                   # the gateway aborts upstream
    rid = stub.requests[-1].request_id
    assert wait_until(lambda: rid in stub.aborts, 5)
    assert _paths(stub, f"Bearer {SECRET}") == {"/internal/info", "/internal/generate", "/internal/abort"}
    assert all(got == f"Bearer {SECRET}" for _, got in stub.auth_seen)


def test_the_env_variable_wins_over_the_config(harness, monkeypatch):
    monkeypatch.setenv("EDGEINFER_INTERNAL_SECRET", "from-the-environment-123")
    stub = harness.stub(secret="from-the-environment-123")
    gw = harness.gateway([stub], internal_secret=SECRET)
    assert client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).choices[0].message.content


def test_a_gateway_with_the_wrong_secret_gets_no_service_and_says_so(harness):
    stub = harness.stub(secret=SECRET)
    gw = harness.gateway([stub], internal_secret="not-the-right-secret")
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert e.value.status_code == 503
    assert stub.requests == []                       # the probe's 401 kept the node out of routing
    assert {got for _, got in stub.auth_seen} == {"Bearer not-the-right-secret"}


def test_no_secret_configured_sends_no_credential(harness, monkeypatch):
    monkeypatch.delenv("EDGEINFER_INTERNAL_SECRET", raising=False)
    stub = harness.stub()
    gw = harness.gateway([stub])
    assert client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).choices[0].message.content
    assert stub.auth_seen and all(got is None for _, got in stub.auth_seen)
    assert requests.get(gw.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("bad", ["has space", "new\nline", "tab\there"])
def test_a_secret_that_would_break_the_header_is_a_config_error(tokenizer_dir, bad):
    cfg = config_mod.parse(gateway_config(tokenizer_dir, [], internal_secret=bad))
    with pytest.raises(config_mod.ConfigError, match="printable characters without whitespace"):
        _ = cfg.internal_auth
