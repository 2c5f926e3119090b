"""Redis is untrusted storage: a page written by anyone without the deployment's page key is never served.

In-process engine on the real SmolLM2 model + PageStoreBridge (Redis tier only) + a real valkey-server.
The attacker has full read/write access to Redis but not the page key: it rewrites one page of a cached
prompt (as the forgery in issue 14 did: the old unkeyed format with a recomputed xxh3 tag, or the current
format with its body replaced, or sealed under a key of its own). Each forged page is a miss: the pages
before it are served, the rest is recomputed, and the output is the cold run's. A correctly keyed page
is served (positive control), and a node holding another deployment's key cannot use these pages.
"""

from __future__ import annotations

import struct
import time

import pytest
import xxhash

from edgeinfer.cache_store import codec
from edgeinfer.cache_store.codec import (
    ENVELOPE_BYTES,
    MAC_BYTES,
    SALT_BYTES,
    DecodedPage,
    PageKey,
    decode,
    encode,
)
from edgeinfer.protocol.page_id import page_hashes
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow
KEY = PageKey.from_secret(b"deployment-page-key-for-tests")
OTHER_KEY = PageKey.from_secret(b"another-deployment-page-key!")
PROMPT = [100 + (i * 7919) % 30000 for i in range(16 * 12 + 1)]    # 12 full pages to fetch
FORGED = 5                                                          # the page the attacker rewrites


def v1_frame(header_bytes: bytes, body: bytes) -> bytes:
    """The pre-MAC page format: envelope v1 | header | body | xxh3-64 of all of it (anyone can compute it)."""
    env = struct.pack("<4sHHIQ", b"EIKV", 1, 0, len(header_bytes), len(body))
    return env + header_bytes + body + struct.pack("<Q", xxhash.xxh3_64_intdigest(env + header_bytes + body))


def parts(blob: bytes) -> tuple[bytes, bytes, bytes]:
    """(envelope, msgpack header, body) of a v2 frame, read the way an attacker would: from the lengths."""
    header_len = int.from_bytes(blob[8:12], "little")
    return (blob[:ENVELOPE_BYTES], blob[ENVELOPE_BYTES:ENVELOPE_BYTES + header_len],
            blob[ENVELOPE_BYTES + header_len:len(blob) - SALT_BYTES - MAC_BYTES])


@pytest.fixture(scope="module")
def engine(smol_dir):
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine

    eng = load_engine(smol_dir, EngineConfig(num_pages=120, cache_seed=b"trust-test-seed"))
    eng.start()
    yield eng
    eng.stop()


class Node:
    """The engine plus one bridge holding `key`; drop() forgets the local prefix cache, so pages come from Redis."""

    def __init__(self, engine, valkey, key: PageKey) -> None:
        from edgeinfer.backend.metrics import BackendMetrics
        from edgeinfer.backend.page_store.bridge import PageStoreBridge
        from edgeinfer.cache_store.resilience import RedisGuard, redis_client
        from edgeinfer.cache_store.store import RedisPageStore, TieredPageStore

        self.engine = engine
        self.client = redis_client(valkey.url, socket_timeout_s=5)
        self.store = RedisPageStore(self.client, guard=RedisGuard(timeout_s=5), timeout_s=5)
        self.metrics = BackendMetrics(engine.model_name)
        self.bridge = PageStoreBridge(engine, node_id=f"trust-{time.monotonic_ns()}", page_key=key,
                                      store=TieredPageStore([("redis", self.store)]), metrics=self.metrics,
                                      redis_client=self.client, fetch_timeout_s=30)

    def integrity_failures(self) -> float:
        return self.metrics.registry.get_sample_value("edgeinfer_backend_integrity_failures_total",
                                                      {"model": self.engine.model_name, "source": "redis"}) or 0.0

    async def drop(self, hashes: list[bytes]) -> None:
        blocks = self.engine.blocks
        await self.engine.call_in_engine(lambda: [blocks.drop_cached(h) for h in hashes])

    async def generate(self, namespace: str) -> tuple[list[int], int]:
        req = GenerateRequest(f"r{time.monotonic_ns()}", PROMPT,
                              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), namespace)
        await self.bridge.before_generate(None, req)
        ids, usage = [], None
        async for ch in self.engine.generate(req):
            ids += ch.token_ids
            usage = ch.usage or usage
        assert usage is not None
        return ids, usage.cached_tokens


async def _published(node: Node, namespace: str) -> tuple[list[int], list[bytes]]:
    """Cold run in `namespace`; returns its output and the page hashes it published to Redis."""
    ref, cached = await node.generate(namespace)
    assert cached == 0
    assert await node.bridge.flush(30)
    hashes = page_hashes(node.engine.key_context(namespace), PROMPT[:12 * 16])
    assert all(await node.store.get_many(hashes)), "the cold run did not publish every page"
    return ref, hashes


@pytest.mark.parametrize("forgery", ["v1_recomputed_xxh3", "v2_body_swapped", "v2_sealed_with_own_key"])
async def test_a_page_forged_without_the_key_is_never_served(engine, valkey, forgery):
    node = Node(engine, valkey, KEY)
    await node.bridge.start()
    try:
        ns = f"forge-{forgery}"
        ref, hashes = await _published(node, ns)
        await node.drop(hashes)
        out, cached = await node.generate(ns)            # positive control: correctly keyed pages are served
        assert cached == 12 * 16 and out == ref
        assert node.bridge.stats.uploaded >= 12

        genuine = await node.store.get_many(hashes)
        env, hdr, body = parts(genuine[FORGED])
        other_body = parts(genuine[FORGED + 1])[2]       # real KV, of another position: changes the output
        forged = {
            "v1_recomputed_xxh3": v1_frame(hdr, other_body),
            "v2_body_swapped": env + hdr + other_body + genuine[FORGED][-SALT_BYTES - MAC_BYTES:],
            "v2_sealed_with_own_key": encode(codec._header_decoder.decode(hdr), other_body, OTHER_KEY),
        }[forgery]
        await node.client.set(node.store.keys.page(hashes[FORGED]), forged)
        before, incompatible = node.integrity_failures(), node.bridge.stats.incompatible
        await node.drop(hashes)
        out, cached = await node.generate(ns)
        assert cached == FORGED * 16, "a forged page (or one after it) was used"
        assert out == ref
        if forgery == "v1_recomputed_xxh3":              # the old format is a miss, left for old nodes
            assert node.bridge.stats.incompatible == incompatible + 1
            assert node.integrity_failures() == before
        else:                                            # a MAC that does not verify: counted and deleted
            assert node.integrity_failures() == before + 1
            stored = await node.client.get(node.store.keys.page(hashes[FORGED]))
            assert stored != forged
        # the recomputed page was published again, sealed with the key: the next fetch serves all of it
        assert await node.bridge.flush(30)
        await node.drop(hashes)
        out, cached = await node.generate(ns)
        assert cached == 12 * 16 and out == ref
    finally:
        await node.bridge.stop()


async def test_a_node_with_another_page_key_cannot_use_the_pages(engine, valkey):
    ours = Node(engine, valkey, KEY)
    await ours.bridge.start()
    try:
        ref, hashes = await _published(ours, "shared-ns")
        await ours.drop(hashes)
    finally:
        await ours.bridge.stop()
    theirs = Node(engine, valkey, OTHER_KEY)             # same seed, same page hashes, another key
    await theirs.bridge.start()
    try:
        blob = (await theirs.store.get_many(hashes[:1]))[0]
        assert blob is not None
        expect = theirs.bridge.format.expect(hashes[0], engine.key_context("shared-ns").root, PROMPT[:16])
        assert isinstance(decode(blob, expect, KEY), DecodedPage)
        assert decode(blob, expect, OTHER_KEY).reason is codec.MissReason.TAG_MISMATCH
        out, cached = await theirs.generate("shared-ns")
        assert cached == 0 and out == ref
        assert theirs.integrity_failures() == 1 and theirs.bridge.stats.uploaded == 0
    finally:
        await theirs.bridge.stop()
