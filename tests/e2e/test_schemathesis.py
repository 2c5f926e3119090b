"""schemathesis against the gateway's own /openapi.json (stub backend): generated valid and invalid requests
to every operation never get a 5xx, and every error is an OpenAI-style {"error": {...}} body."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.gateway.conftest import DEMO_KEY, Harness

SEEN: dict[int, int] = {}


@pytest.fixture(scope="module")
def gateway_url(tokenizer, tokenizer_dir):
    h = Harness(tokenizer, tokenizer_dir)
    try:
        stub = h.stub()
        gw = h.gateway([stub], max_n=4)
        yield gw.url
    finally:
        h.close()


@pytest.fixture(scope="module")
def api_schema(gateway_url):
    return schemathesis.openapi.from_url(gateway_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def check_openai_error_shape(response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body
        assert set(err) <= {"message", "type", "param", "code"}, body


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_gateway_api_never_5xx_and_errors_are_openai_bodies(case, gateway_url):
    # small generated ints for max_tokens make real generations short; the stub is fast anyway
    response = case.call(base_url=gateway_url, headers={"authorization": f"Bearer {DEMO_KEY}"}, timeout=30)
    SEEN[response.status_code] = SEEN.get(response.status_code, 0) + 1
    check_openai_error_shape(response)
    if response.status_code == 200 and "text/event-stream" in response.headers.get("content-type", ""):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_gateway_api_without_a_key_is_401_with_an_openai_body(case, gateway_url):
    response = case.call(base_url=gateway_url, headers={"authorization": "Bearer sk-wrong"}, timeout=30)
    check_openai_error_shape(response)
    assert response.status_code in (401, 405), (case.method, response.status_code)


def test_generated_cases_reached_both_success_and_validation_errors():
    """Guards the two tests above against a schema or config that makes them vacuous."""
    assert SEEN.get(200, 0) > 0 and SEEN.get(422, 0) + SEEN.get(400, 0) > 0, SEEN
