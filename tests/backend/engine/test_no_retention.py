"""retain=false tenants on the real engine + page store bridge (host tier, Redis tier and Redis index on a real
valkey-server): their pages are never cached, published, fetched or indexed."""

from __future__ import annotations

import random
import time

import pytest

from edgeinfer.protocol.page_id import page_hashes
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams, TenantSpec

PRIVATE = TenantSpec("priv", retain=False)
KEEPER = TenantSpec("keeper")


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def generate(engine, bridge, ids: list[int], ns: str, tenant: TenantSpec):
    req = GenerateRequest(f"r{time.monotonic_ns()}", ids, SamplingParams(max_tokens=20, temperature=0.0,
                                                                          ignore_eos=True), ns, tenant=tenant)
    await bridge.before_generate(None, req)
    out, usage = [], None
    async for ch in engine.generate(req):
        out += ch.token_ids
        usage = ch.usage or usage
    return out, usage


@pytest.fixture
async def stack(smol_dir, valkey):
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine
    from edgeinfer.backend.page_store.bridge import PageStoreBridge
    from edgeinfer.cache_store.codec import PageKey
    from edgeinfer.cache_store.index import RedisPageIndex
    from edgeinfer.cache_store.resilience import RedisGuard, redis_client
    from edgeinfer.cache_store.store import HostPageStore, RedisPageStore, TieredPageStore

    engine = load_engine(smol_dir, EngineConfig(num_pages=128, cache_seed=b"no-retain-test"))
    engine.start()
    client = redis_client(valkey.url, socket_timeout_s=5)
    await client.flushall()
    guard = RedisGuard(timeout_s=5)
    host = HostPageStore(1 << 28)
    index = RedisPageIndex(client, guard=guard)
    bridge = PageStoreBridge(engine, node_id="node-nr", store=TieredPageStore(
        [("host", host), ("redis", RedisPageStore(client, guard=guard, timeout_s=5))]),
        page_key=PageKey.from_secret(b"no-retain-page-key"), index=index, redis_client=client, fetch_timeout_s=10)
    await bridge.start()
    try:
        yield engine, bridge, host, index, client
    finally:
        await bridge.stop()
        engine.stop()


async def tiers_hold(engine, host, index, client, hashes: list[bytes]) -> dict[str, int]:
    return {"local": sum(h in engine.blocks.cache for h in hashes),
            "host": sum(host.get(h) is not None for h in hashes),
            "index": max((await index.longest_prefix(engine.model_name, hashes)).values(), default=0),
            "redis_keys": await client.dbsize()}


async def test_no_retain_tenant_leaves_no_page_in_any_tier_or_the_index(stack):
    engine, bridge, host, index, client = stack
    ids = prompt(1)
    ctx = engine.key_context("tenant:priv")
    hashes = page_hashes(ctx, ids)
    first, usage = await generate(engine, bridge, ids, "tenant:priv", PRIVATE)
    assert usage.cached_tokens == 0
    assert await bridge.flush(10)
    await bridge.publish_hot_pages()           # what a drain would publish
    assert await bridge.flush(10)
    assert await tiers_hold(engine, host, index, client, hashes) == \
        {"local": 0, "host": 0, "index": 0, "redis_keys": 0}
    assert "priv" not in engine.blocks.held and engine.blocks.num_used == 0
    again, usage = await generate(engine, bridge, ids, "tenant:priv", PRIVATE)   # nothing was kept
    assert usage.cached_tokens == 0 and again == first
    assert bridge.stats.published == 0

    # the same prompt from a retaining tenant is cached, published and indexed (the setup can see pages)
    keep_hashes = page_hashes(engine.key_context("tenant:keeper"), ids)
    kept, usage = await generate(engine, bridge, ids, "tenant:keeper", KEEPER)
    assert kept == first
    assert await bridge.flush(10)
    seen = await tiers_hold(engine, host, index, client, keep_hashes)
    assert seen["local"] == seen["host"] == seen["index"] == len(keep_hashes) == 12    # the prompt's full pages
    assert seen["redis_keys"] > 0 and engine.blocks.held["keeper"] == 13                # + one of its answer


async def test_no_retain_tenant_in_a_shared_group_fetches_nothing(stack):
    """A retaining tenant published a prefix in group "shared"; a no-retain tenant of the same group sending that
    prompt neither fetches it into this node nor makes the node index it (which would reveal its prompt)."""
    engine, bridge, host, index, client = stack
    ids = prompt(2)
    hashes = page_hashes(engine.key_context("shared"), ids)
    await generate(engine, bridge, ids, "shared", KEEPER)
    assert await bridge.flush(10)
    await engine.call_in_engine(lambda: [engine.blocks.drop_cached(h) for h in hashes])
    await bridge.unindex_evicted()
    assert (await tiers_hold(engine, host, index, client, hashes))["index"] == 0
    fetches = bridge.stats.fetch_requests
    _, usage = await generate(engine, bridge, ids, "shared", PRIVATE)
    assert bridge.stats.fetch_requests == fetches and bridge.stats.uploaded == 0
    assert usage.cached_tokens == 0
    seen = await tiers_hold(engine, host, index, client, hashes)
    assert seen["local"] == 0 and seen["index"] == 0 and seen["host"] == len(hashes)
