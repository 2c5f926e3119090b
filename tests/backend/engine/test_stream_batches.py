"""The backend's per-token HTTP cost: a lagging reader gets its backlog in one write, a stream arms one
keepalive timer (not one per chunk), and keepalives still come while the request waits on a working engine."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from aiohttp import web

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.server import BackendState
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams, StreamChunk
from tests.support.inproc import serve

PROMPT = list(range(100, 140))


def request(rid: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           "tenant-a")


@pytest.fixture
async def backend(smol_model, smol_tokenizer):
    engine = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=128))
    st = BackendState(engine=engine, metrics=BackendMetrics("smol"), node_id="n-batches")
    async with serve(st) as http:
        yield st, http


@pytest.fixture
def ndjson_writes(monkeypatch) -> list[bytes]:
    """Every body write of an NDJSON (generate) response, as the server hands it to aiohttp."""
    writes: list[bytes] = []
    write = web.StreamResponse.write

    async def counting(self, data):
        if self.headers.get("content-type") == "application/x-ndjson":
            writes.append(bytes(data))
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counting)
    return writes


def block_loop_until_finished(engine: LLMEngine, rid: str, timeout_s: float = 300.0) -> None:
    """Hold the event loop (a reader that lags) while the engine thread generates the whole answer."""
    end = time.monotonic() + timeout_s
    while rid in engine._seqs:
        assert time.monotonic() < end, "engine did not finish the request"
        time.sleep(0.01)
    time.sleep(0.3)      # the step's chunks are handed to the loop right after it (_flush)


async def test_a_lagging_reader_gets_the_backlog_in_one_write(backend, ndjson_writes):
    st, http = backend
    n = 12
    body = msgspec.json.encode(request("lag", n))
    async with http.post("/internal/generate", data=body) as r:
        first = await r.content.readline()
        block_loop_until_finished(st.engine, "lag")
        rest = [line async for line in r.content]
    lagged = [msgspec.json.decode(x, type=StreamChunk) for x in [first, *rest] if x.strip()]
    assert len(lagged) == n and lagged[-1].finish_reason == "length" and lagged[-1].usage.completion_tokens == n
    writes = len(ndjson_writes)
    assert writes <= 4, f"{writes} writes for {n} chunks: the backlog was not coalesced"   # old server: 12

    ndjson_writes.clear()
    async with http.post("/internal/generate", data=msgspec.json.encode(request("steady", n))) as r:
        steady = [msgspec.json.decode(x, type=StreamChunk) async for x in r.content if x.strip()]
    assert [c.token_ids for c in steady] == [c.token_ids for c in lagged]      # same tokens, same framing
    assert "".join(c.text for c in steady) == "".join(c.text for c in lagged)
    assert b"".join(ndjson_writes).count(b"\n") == n


async def test_a_stream_arms_one_keepalive_timer_not_one_per_chunk(smol_model, smol_tokenizer):
    engine = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=128))
    engine.start()
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    call_at = loop.call_at

    def counting(when, callback, *args, **kw):
        timers.append(when)
        return call_at(when, callback, *args, **kw)

    loop.call_at = counting       # type: ignore[method-assign]
    try:
        chunks = [c async for c in engine.stream(request("timers", 16), keepalive_s=60.0)]
    finally:
        del loop.call_at
        engine.stop()
    assert len(chunks) == 16 and chunks[-1].finish_reason == "length"
    assert len(timers) <= 2, f"{len(timers)} loop timers for 16 chunks"      # old engine: one per chunk


async def test_keepalives_come_while_queued_on_a_working_engine_and_not_on_a_stopped_one(smol_model,
                                                                                         smol_tokenizer):
    engine = LLMEngine(smol_model, smol_tokenizer, EngineConfig(num_pages=128, max_num_seqs=1))
    long = engine.stream(request("long", 40), keepalive_s=0.2)
    queued = engine.stream(request("queued", 2), keepalive_s=0.2)
    first_long = asyncio.ensure_future(long.__anext__())
    first_queued = asyncio.ensure_future(queued.__anext__())
    await asyncio.sleep(0.8)              # engine not started: no steps, so no keepalives
    assert not first_queued.done() and not first_long.done()
    engine.start()
    try:
        seen: list[StreamChunk | None] = [await first_queued]
        while seen[-1] is None or seen[-1].finish_reason is None:
            seen.append(await queued.__anext__())
        assert seen[0] is None, "the queued request got no keepalive while the engine worked on another"
        assert seen[-1].finish_reason == "length" and sum(1 for c in seen if c is not None) == 2
    finally:
        first_long.cancel()
        await long.aclose()
        await queued.aclose()
        engine.stop()
