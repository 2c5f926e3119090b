"""Status codes and OpenAI error bodies: 400/403/404/413/429/503 (no 422: OpenAI answers 400), rate limits in
Redis and in-process."""

from __future__ import annotations

import openai
import pytest
import requests

from edgeinfer.gateway import config as config_mod
from tests.conftest import wait_until
from tests.gateway.conftest import DEMO_KEY, METRICS_AUTH, MODEL, OTHER_KEY, client, tenant

MSGS = [{"role": "user", "content": "hi"}]
AUTH = {"authorization": f"Bearer {DEMO_KEY}"}


def post(gw, body, path="/v1/chat/completions", **kw):
    kw.setdefault("headers", AUTH)
    if body is not None:
        kw["json"] = body
    return requests.post(gw.url + path, timeout=10, **kw)


def test_model_not_allowed_is_403_and_unknown_model_404(harness):
    tenants = [tenant(models=["other-model"]), tenant(id="t2", api_key_sha256=[config_mod.hash_key(OTHER_KEY)])]
    gw = harness.gateway([harness.stub()], tenants=tenants)
    with pytest.raises(openai.PermissionDeniedError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=MSGS)
    assert e.value.body["code"] == "model_not_allowed" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client(gw, key=OTHER_KEY).chat.completions.create(model="nope", messages=MSGS)
    assert client(gw).models.list().data == []


@pytest.mark.parametrize("extra, status, param", [
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"n": 100}, 400, "n"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 10_000}, 400, "max_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
     400, "response_format.json_schema.schema.type"),
    ({"n": "two"}, 400, "n"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"not_a_field": 1}, 400, "not_a_field"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": []}, 400, "messages"),
])
def test_bad_params(harness, extra, status, param):
    gw = harness.gateway([harness.stub()])
    r = post(gw, {"model": MODEL, "messages": MSGS, **extra})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_openai_client_sees_bad_request_for_every_validation_error(harness):
    """Issue 54, item 4: OpenAI answers 400 to a wrong type or a missing field; a 422 is UnprocessableEntityError
    in the SDK, which code written for OpenAI does not catch as BadRequestError."""
    gw = harness.gateway([harness.stub()])
    with pytest.raises(openai.BadRequestError):
        client(gw).chat.completions.create(model=MODEL, messages=MSGS, temperature=-3)
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=MSGS, extra_body={"top_k": "many"})
    assert e.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens="x")   # type: ignore[arg-type]
    assert e.value.body["param"] == "max_tokens"
    for body, param in (({"model": MODEL}, "messages"), ({"messages": MSGS}, "model")):
        r = post(gw, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["code"] == "missing_required_parameter"
    r = post(gw, {"model": MODEL}, path="/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_not_json_is_400(harness):
    gw = harness.gateway([harness.stub()])
    r = post(gw, None, data=b"{not json", headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_body_too_large_is_413(harness):
    gw = harness.gateway([harness.stub()], max_body_bytes=10_000)
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 20_000}])
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"


def test_tenant_prompt_limit_is_400(harness):
    gw = harness.gateway([harness.stub()], tenants=[tenant(max_prompt_tokens=10)])
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 50}])
    assert e.value.body["code"] == "context_length_exceeded"


def test_no_healthy_backend_is_503(harness):
    stub = harness.stub()
    stub.behaviour.ready = False
    gw = harness.gateway([stub])
    with pytest.raises(openai.InternalServerError) as e:
        client(gw).chat.completions.create(model=MODEL, messages=MSGS)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"


def test_unknown_route_is_openai_json_404(harness):
    gw = harness.gateway([harness.stub()])
    r = requests.get(gw.url + "/v1/nothing", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def _limit_429(gw):
    c = client(gw)
    ok = c.chat.completions.with_raw_response.create(model=MODEL, messages=MSGS, max_tokens=1)
    assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    h = e.value.response.headers
    assert int(h["retry-after"]) >= 1 and h["x-ratelimit-remaining-requests"] == "0"
    assert e.value.body["code"] == "rate_limit_exceeded"
    m = requests.get(gw.url + "/metrics", headers=METRICS_AUTH, timeout=5).text
    assert 'edgeinfer_gateway_rate_limit_rejections_total{limit="requests",tenant="demo"} 1.0' in m


def test_remaining_requests_is_whole_at_any_clock_value():
    """The in-process limiter's clock is ms since boot in a float: at 67106.838... s, now + 30000 - now is
    30000.000000004, so without a tolerance one request held read as 0.9999999 of one
    (x-ratelimit-remaining-requests 0 after the first of 2; seen once in CI) and the second of 2 requests at
    the same instant was refused. Also at a fractional interval (7 per minute)."""
    from edgeinfer.gateway.admission.ratelimit import LocalLimiter
    from edgeinfer.gateway.config import TenantConfig

    for now_s in (67106.83814093204, 32412.345678, 1.5):
        for per_min in (2, 7):
            lim = LocalLimiter(clock=lambda now_s=now_s: now_s)
            t = TenantConfig(id="x", api_key_sha256=[], requests_per_min=per_min)
            got = [lim.acquire(t, 0).remaining["requests"] for _ in range(per_min)]
            assert got == list(range(per_min - 1, -1, -1)), (now_s, per_min, got)
            assert not lim.acquire(t, 0).allowed


def test_requests_per_min_in_process(harness):
    _limit_429(harness.gateway([harness.stub()], tenants=[tenant(requests_per_min=2)]))


def test_requests_per_min_in_redis_shared_by_two_gateways(harness, valkey):
    import redis

    redis.Redis.from_url(valkey.url).flushall()
    stub = harness.stub()
    gw1 = harness.gateway([stub], tenants=[tenant(requests_per_min=2)], redis_url=valkey.url)
    gw2 = harness.gateway([stub], tenants=[tenant(requests_per_min=2)], redis_url=valkey.url)
    client(gw1).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    client(gw2).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        client(gw1).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    keys = sorted(k.decode() for k in redis.Redis.from_url(valkey.url).keys("ei:rl:*"))
    assert keys == ["ei:rl:{demo}:requests"]


def test_tokens_per_min_in_redis(harness, valkey):
    import redis

    redis.Redis.from_url(valkey.url).flushall()
    gw = harness.gateway([harness.stub()], tenants=[tenant(tokens_per_min=100)], redis_url=valkey.url)
    c = client(gw)
    r = c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "a" * 20}],
                                                    max_tokens=30)
    prompt_tokens = r.parse().usage.prompt_tokens
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == 100 - prompt_tokens
    # completion tokens are charged after the response: the budget is now below one more prompt
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a" * 20}], max_tokens=1)
    assert "tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):  # can never fit in the budget
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a" * 200}], max_tokens=1)


def test_concurrent_stream_limit(harness):
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.02
    gw = harness.gateway([stub], tenants=[tenant(max_concurrent_streams=1)])
    c = client(gw)
    stream = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, stream=True)
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    assert e.value.body["code"] == "concurrency_limit_exceeded"
    stream.close()


def test_concurrent_stream_limit_shared_by_two_gateways_in_redis(harness, valkey):
    import redis

    r = redis.Redis.from_url(valkey.url)
    r.flushall()
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.05
    gw1 = harness.gateway([stub], tenants=[tenant(max_concurrent_streams=2)], redis_url=valkey.url)
    gw2 = harness.gateway([stub], tenants=[tenant(max_concurrent_streams=2)], redis_url=valkey.url)
    s1 = client(gw1).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=60, stream=True)
    next(iter(s1))
    s2 = client(gw2).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=60, stream=True)
    next(iter(s2))
    assert r.zcard("ei:cc:{demo}") == 2
    for gw in (gw1, gw2):     # each gateway holds one stream; the cap of 2 is the tenant's, not per gateway
        with pytest.raises(openai.RateLimitError) as e:
            client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
        assert e.value.body["code"] == "concurrency_limit_exceeded"
    s1.close()
    wait_until(lambda: r.zcard("ei:cc:{demo}") == 1, 10.0, what="lease count 1")     # the lease goes back when the stream ends
    out = client(gw2).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    assert out.choices[0].finish_reason == "length"
    s2.close()
    wait_until(lambda: r.zcard("ei:cc:{demo}") == 0, 10.0, what="lease count 0")


def _redis_admission(client, ttl_s: float):
    from edgeinfer.gateway.admission import RedisAdmission

    return RedisAdmission(client, ttl_s=ttl_s)


async def test_stream_leases_of_a_dead_gateway_expire(valkey):
    import asyncio

    import redis.asyncio as aredis

    from edgeinfer.gateway.config import TenantConfig

    c = aredis.Redis.from_url(valkey.url)
    await c.flushall()
    t = TenantConfig(id="t1", api_key_sha256=[], max_concurrent_streams=2)
    dead = _redis_admission(c, ttl_s=0.4)               # takes the whole cap and never refreshes
    for _ in range(2):
        decision, lease = await dead.admit(t, 1)
        assert decision.allowed and lease is not None and lease.kind == "redis"
    alive = _redis_admission(c, ttl_s=0.4)
    assert (await alive.admit(t, 1))[1] is None
    await asyncio.sleep(0.6)
    _, lease = await alive.admit(t, 1)                  # the dead gateway's leases expired
    assert lease is not None and lease.kind == "redis"
    assert alive.streams.held == {"t1": {lease.lease_id}}
    for _ in range(4):                                  # a refreshed lease outlives its TTL
        await asyncio.sleep(0.15)
        await alive.streams.refresh()
    assert await c.zscore("ei:cc:{t1}", lease.lease_id) is not None
    assert not alive.finish_now(t, lease, 0)            # a Redis lease is settled by finish, from a task
    await alive.finish(t, lease, 0)
    assert await c.zcard("ei:cc:{t1}") == 0 and alive.streams.held == {}
    await c.aclose()


async def test_admission_falls_back_to_in_process_limits_when_redis_is_down():
    import redis.asyncio as aredis

    from edgeinfer.gateway.admission.leases import RedisStreamLimiter
    from edgeinfer.gateway.config import TenantConfig

    c = aredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.1)   # nothing listens on port 1
    adm = _redis_admission(c, ttl_s=5)
    t = TenantConfig(id="t1", api_key_sha256=[], max_concurrent_streams=1, requests_per_min=2)
    decision, first = await adm.admit(t, 1)
    assert decision.allowed and first is not None and first.kind == "local"
    decision, second = await adm.admit(t, 1)
    assert second is None                               # the cap still holds, on this gateway's count
    assert adm.finish_now(t, first, 0)                  # a local lease goes back at once
    decision, third = await adm.admit(t, 1)             # the refused one spent no rate budget: 2 of 2/min
    assert decision.allowed and third is not None and third.kind == "local"
    assert adm.finish_now(t, third, 0)
    decision, fourth = await adm.admit(t, 1)
    assert not decision.allowed and fourth is None      # the in-process rate limit (2/min) holds too
    assert adm.streams.local.active == {}               # and the rate refusal gave its lease back
    assert adm.failures >= 3
    unlimited = TenantConfig(id="t2", api_key_sha256=[])
    assert (await adm.admit(unlimited, 1))[1].kind == "none"
    with pytest.raises(ValueError, match="ttl_s=0"):
        RedisStreamLimiter(c, ttl_s=0)
    await c.aclose()


def test_request_refused_by_the_stream_cap_spends_no_rate_budget(harness, valkey):
    import redis

    r = redis.Redis.from_url(valkey.url)
    r.flushall()
    stub = harness.stub()
    stub.behaviour.token_delay_s = 0.05
    gw = harness.gateway([stub], tenants=[tenant(requests_per_min=3, max_concurrent_streams=1)],
                         redis_url=valkey.url)
    c = client(gw)
    s1 = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=60, stream=True)   # request 1 of 3
    next(iter(s1))
    with pytest.raises(openai.RateLimitError) as e:                                          # refused by the cap
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    assert e.value.body["code"] == "concurrency_limit_exceeded"
    s1.close()
    wait_until(lambda: r.zcard("ei:cc:{demo}") == 0, 10.0, what="lease count 0")
    ok = c.chat.completions.with_raw_response.create(model=MODEL, messages=MSGS, max_tokens=1)    # request 2 of 3
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"       # the refused one did not count
