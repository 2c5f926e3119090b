"""The page hand-off of prefill/decode disaggregation (backend/page_store/handoff.py), on two real backends served
in-process over loopback HTTP (backend.server.make_app), a tiny random Llama (transformers' classes, safetensors),
fp32 KV; no page store tier (the hand-off needs none).

- a prefill-only request answers one "prefilled" chunk, no token, the usage;
- the decode node pulls every full page of the prompt, decodes the same greedy tokens as a cold run, computes
  only the tail; the prefill node counts the pages sent, the decode node the pages received;
- a page corrupted in the prefill node's pool after sealing is never sent (its checksum fails on the way out):
  the pages before it are handed over, the rest recomputed, the output unchanged;
- bad page requests get a 400 naming what was expected; the frame reader drops a truncated last frame and holds
  its bounds (frames per page asked, bytes per frame).
"""

from __future__ import annotations

import asyncio
import resource
import struct
from contextlib import asynccontextmanager

import msgspec
import pytest
from aiohttp import web

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.page_store.bridge import PageStoreBridge
from edgeinfer.backend.page_store.handoff import BLOB_SLACK, FrameError, read_frames
from edgeinfer.backend.server import BackendState
from edgeinfer.cache_store.codec import PageKey
from edgeinfer.protocol.page_id import page_hashes
from edgeinfer.protocol.wire import StreamChunk
from tests.support.inproc import serve
from tests.support.kv_faults import ENV, KVFaults
from tests.support.tiny import prompt, tiny_llama

PAGE = 16
KEY = PageKey.from_secret(b"handoff-test-page-key-0123456789")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(tiny_llama(tmp_path_factory.mktemp("tiny")))


def node(model, node_id: str, role: str, **bridge) -> BackendState:
    engine = LLMEngine(model, None, EngineConfig(num_pages=64, page_size=PAGE, kv_dtype="fp32",
                                                 max_num_batched_tokens=64))
    metrics = BackendMetrics("tiny")
    engine.observers.append(metrics)
    st = BackendState(engine=engine, metrics=metrics, node_id=node_id, role=role)
    ext = PageStoreBridge(engine, node_id=node_id, store=None, page_key=KEY, metrics=metrics, role=role,
                          handoff_timeout_s=5.0, **bridge)
    engine.observers.append(ext)
    st.extensions.append(ext)
    return st


async def generate(http, ids: list[int], ns: str, **extra) -> list[StreamChunk]:
    body = {"request_id": f"r-{ns}-{extra.get('prefill_only', False)}", "prompt_token_ids": ids, "cache_namespace": ns,
            "sampling": {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}, **extra}
    async with http.post("/internal/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return [msgspec.json.decode(line, type=StreamChunk) async for line in r.content if line.strip()]


def tokens(chunks: list[StreamChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def handoff(st: BackendState):
    return st.extensions[0].handoff.handoff.stats


@asynccontextmanager
async def prefilled(tiny, seed: int, full_pages: int):
    """A prefill node and a decode node served, the decode node's cold tokens for a prompt of `full_pages` pages + 1
    token, and that prompt prefilled on the prefill node: (p, d, ph, dh, ids, cold)."""
    p, d = node(tiny, "p", "prefill"), node(tiny, "d", "decode")
    ids = prompt(seed, PAGE * full_pages + 1)
    async with serve(p) as ph, serve(d) as dh:
        cold = tokens(await generate(dh, ids, "cold"))
        await generate(ph, ids, "ns", prefill_only=True)
        yield p, d, ph, dh, ids, cold


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` served on a free loopback port: (runner to clean up, its URL)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def frames(data: bytes, limit: int = 10, max_blob: int = 1 << 20) -> list[bytes]:
    """read_frames over bytes as a stream would deliver them (the same reader a decode node uses)."""
    stream = asyncio.StreamReader()
    stream.feed_data(data)
    stream.feed_eof()
    return await read_frames(stream, limit, max_blob)


def trust(d: BackendState, *urls: str) -> None:
    """What --handoff-peers URL,... sets: the prefill nodes decode node `d` may pull from."""
    d.extensions[0].handoff.peers = frozenset(u.rstrip("/") for u in urls)


async def test_prefill_then_pull_gives_the_cold_tokens_and_moves_every_full_page(tiny):
    p, d = node(tiny, "p", "prefill"), node(tiny, "d", "decode")
    ids = prompt(1, 16 * 5 + 3)     # 5 full pages + 3 tokens
    async with serve(p) as ph, serve(d) as dh:
        cold = tokens(await generate(dh, ids, "cold"))
        first = await generate(ph, ids, "ns", prefill_only=True)
        assert len(first) == 1 and first[0].finish_reason == "prefilled" and first[0].token_ids == []
        assert first[0].usage.prompt_tokens == len(ids)
        url = str(ph._base_url)
        trust(d, url)
        out = await generate(dh, ids, "ns", kv_source={"node_id": "p", "url": url})
    assert tokens(out) == cold
    assert out[-1].usage.cached_tokens == 5 * PAGE            # the handed-off pages hit d's prefix cache
    assert handoff(p)["sent"] == 5 and handoff(d)["received"] == 5 and handoff(d)["rejected"] == 0
    assert d.engine.integrity.ledger.checks["handoff_receive"] == 5      # each page read back after the write
    assert p.engine.integrity.ledger.checks["handoff_send"] == 5


async def test_a_page_corrupted_in_the_prefill_pool_is_never_sent(tiny, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    async with prefilled(tiny, 2, 6) as (p, d, ph, dh, ids, cold):
        ctx = p.engine.key_context("ns")
        third = p.engine.blocks.lookup(page_hashes(ctx, ids[:6 * PAGE])[2]).page
        KVFaults(p.engine).corrupt_page(third)
        trust(d, str(ph._base_url))
        out = await generate(dh, ids, "ns", kv_source={"node_id": "p", "url": str(ph._base_url)})
    assert tokens(out) == cold
    assert handoff(p)["sent"] == 2 and handoff(d)["received"] == 2       # the two pages before the bad one
    assert p.engine.integrity.ledger.failures["handoff_send"] == 1
    assert out[-1].usage.cached_tokens == 2 * PAGE


async def test_bad_page_requests_are_refused(tiny):
    p = node(tiny, "p", "prefill")
    async with serve(p) as ph:
        for payload, needle in ((b"{", "invalid page request"), (b'{"hashes": ["AAAA"]}', "16 bytes"),
                                (b'{"hashes": [], "x": 1}', "invalid page request")):
            async with ph.post("/internal/kv/pages", data=payload) as r:
                assert r.status == 400 and needle in (await r.json())["error"]["message"]
        async with ph.post("/internal/kv/pages", json={"hashes": []}) as r:
            assert r.status == 200 and await r.read() == b""


async def test_a_node_without_a_handoff_answers_404(tiny):
    engine = LLMEngine(tiny, None, EngineConfig(num_pages=16, kv_dtype="fp32"))
    st = BackendState(engine=engine, metrics=BackendMetrics("tiny"), node_id="plain")
    async with serve(st) as http, http.post("/internal/kv/pages", json={"hashes": []}) as r:
        assert r.status == 404 and "no page hand-off" in (await r.json())["error"]["message"]


async def test_frames_round_trip_a_truncated_frame_is_dropped_and_the_bounds_hold():
    blobs = [b"a" * 5, b"", b"xyz" * 100]
    data = b"".join(struct.pack("<I", len(b)) + b for b in blobs)     # what /internal/kv/pages writes
    assert await frames(data) == blobs
    assert await frames(data[:-1]) == blobs[:2]
    assert await frames(data[:3]) == []
    with pytest.raises(FrameError, match="bytes past the 2 pages asked"):
        await frames(data, limit=2)
    with pytest.raises(FrameError, match="a frame of 300 bytes; a page is at most 299"):
        await frames(data, max_blob=299)


async def _listener(seen: list[dict]):
    """A server of the attacker's: records what reaches it (method, path, headers)."""
    async def any_request(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "authorization": request.headers.get("authorization")})
        return web.Response(body=b"")
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_request)
    return await start_app(app)


async def test_a_kv_source_the_node_does_not_know_is_never_contacted(tiny):
    """Issue 53, item 1: a decode node sends the internal secret only to prefill nodes it knows (--handoff-peers or
    the signed registry), never to a URL because a request names it: the request is computed instead."""
    secret = "handoff-test-internal-secret-0123456789"
    d = node(tiny, "d", "decode", internal_secret=secret)
    seen: list[dict] = []
    runner, evil = await _listener(seen)
    ids = prompt(3, 16 * 4 + 1)
    try:
        async with serve(d) as dh:
            cold = tokens(await generate(dh, ids, "cold"))
            trust(d, "http://127.0.0.1:1")        # another peer is known; this URL is not
            out = await generate(dh, ids, "ns", kv_source={"node_id": "p", "url": evil})
    finally:
        await runner.cleanup()
    assert seen == []                            # no connection, so no secret
    assert tokens(out) == cold and handoff(d)["pull_refused"] == 1 and handoff(d)["pulls"] == 0


async def test_a_prefill_node_in_the_signed_registry_is_known(tiny, valkey):
    from edgeinfer.cache_store.node_auth import NodeRecordKey
    from edgeinfer.cache_store.node_record import NodeRecord
    from edgeinfer.cache_store.wiring import wire_redis

    secret = "handoff-test-internal-secret-0123456789"
    wiring = wire_redis(valkey.url, "hand")
    registry = wiring.registry(heartbeat_s=2.0, signer=NodeRecordKey(secret))
    d = node(tiny, "d", "decode", internal_secret=secret, registry=registry)
    kv = d.extensions[0].handoff
    from edgeinfer.protocol.wire import KVSource

    await registry.register(NodeRecord("p1", "http://10.0.0.7:8100", "tiny", "1", role="prefill"))
    assert await kv.known_peer(KVSource("p1", "http://10.0.0.7:8100/"))
    assert not await kv.known_peer(KVSource("p1", "http://10.0.0.8:8100"))     # the id's record names another URL
    assert not await kv.known_peer(KVSource("p2", "http://10.0.0.7:8100"))
    forged = NodeRecord("p3", "http://evil:1", "tiny", "1", role="prefill")  # written without the secret: unsigned
    unsigned = wiring.registry(heartbeat_s=2.0)
    await unsigned.register(forged)
    assert not await kv.known_peer(KVSource("p3", "http://evil:1"))
    await wiring.client.aclose()


async def test_a_page_request_names_each_page_of_one_chain_once(tiny):
    """Issue 53, item 2: one hash repeated is refused (it made a node build 4,096 copies, 779 MB); more hashes than one
    context's pages are refused; hashes of two chains answer the first chain's run only; the answer is streamed."""
    p = node(tiny, "p", "prefill")
    ids = prompt(4, 16 * 3 + 1)
    other = prompt(5, 16 * 3 + 1)
    async with serve(p) as ph:
        await generate(ph, ids, "ns", prefill_only=True)
        await generate(ph, other, "ns", prefill_only=True)
        ctx = p.engine.key_context("ns")
        chain, chain2 = page_hashes(ctx, ids[:3 * PAGE]), page_hashes(ctx, other[:3 * PAGE])
        async with ph.post("/internal/kv/pages", json=msgspec.to_builtins({"hashes": [chain[0]] * 8})) as r:
            assert r.status == 400 and "repeated" in (await r.json())["error"]["message"]
        most = -(-p.engine.max_model_len // PAGE)
        fake = [i.to_bytes(16, "little") for i in range(most + 1)]
        async with ph.post("/internal/kv/pages", json=msgspec.to_builtins({"hashes": fake})) as r:
            assert r.status == 400 and "one context" in (await r.json())["error"]["message"]
        async with ph.post("/internal/kv/pages", json=msgspec.to_builtins({"hashes": chain})) as r:
            assert r.status == 200 and r.headers.get("transfer-encoding") == "chunked"
            assert len(await frames(await r.read())) == 3
        mixed = [chain[0], chain2[1], chain[1]]          # the second is held, but not the first's child
        async with ph.post("/internal/kv/pages", json=msgspec.to_builtins({"hashes": mixed})) as r:
            assert len(await frames(await r.read())) == 1


@pytest.mark.parametrize("answer", ["oversized_frame", "appended_512mb"])
async def test_a_prefill_nodes_answer_is_bounded_before_it_is_buffered(tiny, answer):
    """Issue 53, item 3: a prefill node (the attacker here, a real HTTP server) that answers a frame bigger than a
    page, or the right pages with 512 MB appended, fails the hop (counted); the decode node computes the prompt,
    and its peak memory does not follow the attacker's bytes (it read 1.5 GB before)."""
    async with prefilled(tiny, 6, 4) as (p, d, ph, dh, ids, cold):
        ctx = p.engine.key_context("ns")
        async with ph.post("/internal/kv/pages", json=msgspec.to_builtins(
                {"hashes": page_hashes(ctx, ids[:4 * PAGE])})) as r:
            genuine = await r.read()
        page_bytes = d.extensions[0].handoff.page_bytes

        async def pages(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            if answer == "oversized_frame":
                await resp.write(struct.pack("<I", page_bytes + BLOB_SLACK + 1))
            else:
                await resp.write(genuine)
            chunk = b"\0" * (1 << 20)
            try:
                for _ in range(512):
                    await resp.write(chunk)
            except (ConnectionResetError, asyncio.CancelledError):
                pass
            return resp

        app = web.Application()
        app.router.add_post("/internal/kv/pages", pages)
        runner, url = await start_app(app)
        trust(d, url)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            out = await generate(dh, ids, "ns", kv_source={"node_id": "p", "url": url})
        finally:
            await runner.cleanup()
        grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert tokens(out) == cold
    assert handoff(d)["pull_failures"] == 1 and handoff(d)["received"] == 0
    assert grew_mib < 128, f"peak RSS grew {grew_mib:.0f} MiB while the peer sent 512 MiB"
