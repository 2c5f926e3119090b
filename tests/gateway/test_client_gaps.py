"""Issue 54, clients: what the openai SDK and other OpenAI clients expect of the API surface. The real gateway app
over loopback, the official openai client; the node is the stub backend (tests/gateway/stub_backend.py)."""

from __future__ import annotations

import openai
import pytest
import requests

from edgeinfer.gateway import config as config_mod
from tests.gateway.conftest import DEMO_KEY, OTHER_KEY, client, tenant

MODEL = "stub-model"


def test_models_retrieve(harness):
    narrow = tenant(id="narrow", models=["other-model"], api_key_sha256=[config_mod.hash_key(OTHER_KEY)])
    gw = harness.gateway([harness.stub()], tenants=[tenant(), narrow])
    m = client(gw).models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by
    assert [x.id for x in client(gw).models.list()] == [MODEL]
    for key, name in ((DEMO_KEY, "no-such-model"), (OTHER_KEY, MODEL)):    # missing or not allowed: the same 404
        with pytest.raises(openai.NotFoundError) as e:
            client(gw, key).models.retrieve(name)
        assert e.value.body["code"] == "model_not_found" and name in e.value.body["message"]
    r = requests.get(gw.url + f"/v1/models/{MODEL}", timeout=5)
    assert r.status_code == 401


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nothing"), ("POST", "/v1/chat/complete"),
                                              ("GET", "/v2/models"), ("DELETE", "/v1/embeddings")])
def test_an_unknown_route_is_an_openai_404_naming_it(harness, method, path):
    gw = harness.gateway([harness.stub()])
    r = requests.request(method, gw.url + path, headers={"authorization": f"Bearer {DEMO_KEY}"}, timeout=5)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["code"] == "unknown_url" and path in err["message"]


def test_a_wrong_method_is_an_openai_405(harness):
    gw = harness.gateway([harness.stub()])
    r = requests.get(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {DEMO_KEY}"}, timeout=5)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and "POST" in r.headers["allow"]
