"""The page hand-off of prefill/decode disaggregation (backend/page_store/handoff.py), on two real backends served
in-process over loopback HTTP (backend.server.make_app), a tiny random Llama (transformers' classes, safetensors),
fp32 KV; no page store tier (the hand-off needs none).

- a prefill-only request answers one "prefilled" chunk, no token, the usage;
- the decode node pulls every full page of the prompt, decodes the same greedy tokens as a cold run, computes
  only the tail; the prefill node counts the pages sent, the decode node the pages received;
- a page corrupted in the prefill node's pool after sealing is never sent (its checksum fails on the way out):
  the pages before it are handed over, the rest recomputed, the output unchanged;
- bad page requests get a 400 naming what was expected; the framing drops a truncated last frame.
"""

from __future__ import annotations

import struct

import msgspec
import pytest

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.kv_faults import ENV, KVFaults
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.page_store.bridge import PageStoreBridge
from edgeinfer.backend.page_store.handoff import unframe
from edgeinfer.backend.server import BackendState
from edgeinfer.cache_store.codec import PageKey
from edgeinfer.protocol.page_id import page_hashes
from edgeinfer.protocol.wire import StreamChunk
from tests.support.inproc import serve
from tests.support.tiny import prompt, tiny_llama

PAGE = 16
KEY = PageKey.from_secret(b"handoff-test-page-key-0123456789")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(tiny_llama(tmp_path_factory.mktemp("tiny")))


def node(model, node_id: str, role: str) -> BackendState:
    engine = LLMEngine(model, None, EngineConfig(num_pages=64, page_size=PAGE, kv_dtype="fp32",
                                                 max_num_batched_tokens=64))
    metrics = BackendMetrics("tiny")
    engine.observers.append(metrics)
    st = BackendState(engine=engine, metrics=metrics, node_id=node_id, role=role)
    bridge = PageStoreBridge(engine, node_id=node_id, store=None, page_key=KEY, metrics=metrics, role=role,
                             handoff_timeout_s=5.0)
    engine.observers.append(bridge)
    st.extensions.append(bridge)
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


async def test_prefill_then_pull_gives_the_cold_tokens_and_moves_every_full_page(tiny):
    p, d = node(tiny, "p", "prefill"), node(tiny, "d", "decode")
    ids = prompt(1, 16 * 5 + 3)     # 5 full pages + 3 tokens
    async with serve(p) as ph, serve(d) as dh:
        cold = tokens(await generate(dh, ids, "cold"))
        first = await generate(ph, ids, "ns", prefill_only=True)
        assert len(first) == 1 and first[0].finish_reason == "prefilled" and first[0].token_ids == []
        assert first[0].usage.prompt_tokens == len(ids)
        url = str(ph._base_url)
        out = await generate(dh, ids, "ns", kv_source={"node_id": "p", "url": url})
    assert tokens(out) == cold
    assert out[-1].usage.cached_tokens == 5 * PAGE            # the handed-off pages hit d's prefix cache
    assert handoff(p)["sent"] == 5 and handoff(d)["received"] == 5 and handoff(d)["rejected"] == 0
    assert d.engine.integrity.ledger.checks["handoff_receive"] == 5      # each page read back after the write
    assert p.engine.integrity.ledger.checks["handoff_send"] == 5


async def test_a_page_corrupted_in_the_prefill_pool_is_never_sent(tiny, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    p, d = node(tiny, "p", "prefill"), node(tiny, "d", "decode")
    ids = prompt(2, 16 * 6 + 1)
    async with serve(p) as ph, serve(d) as dh:
        cold = tokens(await generate(dh, ids, "cold"))
        await generate(ph, ids, "ns", prefill_only=True)
        ctx = p.engine.key_context("ns")
        third = p.engine.blocks.lookup(page_hashes(ctx, ids[:6 * PAGE])[2]).page
        KVFaults(p.engine).corrupt_page(third)
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


def test_frames_round_trip_and_a_truncated_frame_is_dropped():
    blobs = [b"a" * 5, b"", b"xyz" * 100]
    data = b"".join(struct.pack("<I", len(b)) + b for b in blobs)     # what /internal/kv/pages writes
    assert [bytes(b) for b in unframe(data, 10)] == blobs
    assert [bytes(b) for b in unframe(data, 2)] == blobs[:2]
    assert [bytes(b) for b in unframe(data[:-1], 10)] == blobs[:2]
