"""The gateway's relay of a backend stream: chunks that arrived together leave in one write, unchanged."""

from __future__ import annotations

import pytest
from aiohttp import web

from tests.gateway.conftest import MODEL, client
from tests.gateway.stub_backend import PHRASE, StubBehaviour

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def sse_writes(monkeypatch) -> list[bytes]:
    """Every body write of an SSE response, as the gateway hands it to aiohttp."""
    writes: list[bytes] = []
    write = web.StreamResponse.write

    async def counting(self, data):
        if self.headers.get("content-type") == "text/event-stream":
            writes.append(bytes(data))
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counting)
    return writes


def stream_completion(gw, n: int) -> tuple[str, int, list[str | None]]:
    chunks = list(client(gw).completions.create(model=MODEL, prompt="hello", max_tokens=n, stream=True,
                                                stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices]


def test_chunks_buffered_together_reach_the_client_in_one_write(harness, sse_writes):
    gw = harness.gateway([harness.stub(behaviour=StubBehaviour(burst=True))])
    text, used, reasons = stream_completion(gw, 12)
    assert text == PHRASE[:12] and used == 12 and reasons[-1] == "length"
    assert len(sse_writes) == 1, f"{len(sse_writes)} writes for 12 tokens that arrived together"   # old: 15
    assert sse_writes[0].count(b"data: ") == 12 + 3     # tokens, the finish event, usage, [DONE]
    assert sse_writes[0].endswith(b"data: [DONE]\n\n")


def test_chunks_arriving_apart_are_written_as_they_come(harness, sse_writes):
    gw = harness.gateway([harness.stub(behaviour=StubBehaviour(token_delay_s=0.02))])
    text, used, _ = stream_completion(gw, 6)
    assert text == PHRASE[:6] and used == 6
    assert len(sse_writes) >= 6                       # nothing held back waiting for the next token
    assert sse_writes[-1].endswith(b"data: [DONE]\n\n") and b'"usage"' in sse_writes[-1]


def test_chat_stream_from_a_burst_is_the_same_as_token_by_token(harness):
    def chat(stub):
        gw = harness.gateway([stub])
        return [(c.choices[0].delta.role, c.choices[0].delta.content, c.choices[0].finish_reason) if c.choices
                else ("usage", c.usage.completion_tokens, None)
                for c in client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, stream=True,
                                                            stream_options={"include_usage": True})]

    assert chat(harness.stub("node-burst", behaviour=StubBehaviour(burst=True))) == chat(harness.stub("node-steady", behaviour=StubBehaviour(token_delay_s=0.01)))
