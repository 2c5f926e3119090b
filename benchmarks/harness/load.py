"""OpenAI-HTTP load generator shared by every system in bench_peers.

One wave = N concurrent streaming `/v1/completions` requests sent at once, each with its own token-id prompt
(so no prefix cache helps), greedy, a fixed `max_tokens` and `ignore_eos` (every answer has exactly that
many tokens). Each request is one `Shot`; the metrics below are computed from the shots of a wave.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Shot:
    t_send: float
    t_first: float | None       # first event carrying a choice (the first token)
    t_last: float | None        # last event carrying a choice (the last token)
    tokens: int                 # completion tokens (usage if the server sent it, else the events seen)
    prompt_tokens: int | None
    finish: str | None
    error: str | None = None


def _events(buf: bytes) -> tuple[list[bytes], bytes]:
    buf = buf.replace(b"\r\n", b"\n")
    *done, rest = buf.split(b"\n\n")
    return done, rest


class HTTPError(RuntimeError):
    """The server answered the streaming request with a non-200 status."""


async def sse_events(response):
    """(arrival time, decoded JSON) of each `data:` event of a streaming response, [DONE] left out."""
    buf = b""
    async for piece in response.content.iter_any():
        done, buf = _events(buf + piece)
        now = time.perf_counter()
        for ev in done:
            data = b"".join(line[5:].strip() for line in ev.split(b"\n") if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                yield now, json.loads(data)


async def shoot(session, url: str, headers: dict, body: dict) -> Shot:
    import aiohttp

    t0 = time.perf_counter()
    first = last = None
    events = 0
    usage: dict = {}
    finish = None
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                return Shot(t0, None, None, 0, None, None, f"HTTP {r.status}: {(await r.text())[:300]}")
            async for now, obj in sse_events(r):
                if "error" in obj:
                    return Shot(t0, first, last, events, None, None, f"error event: {str(obj['error'])[:300]}")
                if obj.get("usage"):
                    usage = obj["usage"]
                for c in obj.get("choices") or []:
                    finish = c.get("finish_reason") or finish
                    if c.get("text") or (c.get("delta") or {}).get("content") or first is None:
                        first = first if first is not None else now
                        last = now
                        events += 1
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        return Shot(t0, first, last, events, None, finish, f"{type(e).__name__}: {e}")
    return Shot(t0, first, last, int(usage.get("completion_tokens", events)), usage.get("prompt_tokens"), finish)


async def timed_stream(session, url: str, path: str, headers: dict, body: dict) -> dict:
    """One streaming request: its send time, the arrival time of every event carrying text, its usage and (from
    llama-server) its timings; an HTTP error or an error event raises."""
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    timings: dict = {}
    async with session.post(url + path, json=body, headers=headers) as r:
        if r.status != 200:
            raise HTTPError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for now, obj in sse_events(r):
            if "error" in obj:
                raise HTTPError(f"error event: {obj['error']}")
            usage = obj.get("usage") or usage
            timings = obj.get("timings") or timings
            if any(c.get("text") or (c.get("delta") or {}).get("content") for c in obj.get("choices") or []):
                times.append(now)
    return {"t0": t0, "times": times, "usage": usage, "timings": timings}


async def wave(url: str, model: str, api_key: str | None, prompts: list[list[int]] | list[str], max_tokens: int,
               timeout_s: float, extra_body: dict | None = None) -> list[Shot]:
    import aiohttp

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), connector=conn) as s:
        bodies = [{"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra_body or {})} for p in prompts]
        return list(await asyncio.gather(*[shoot(s, url, headers, b) for b in bodies]))


def check(shots: list[Shot], max_tokens: int) -> list[str]:
    """Problems that make a wave's numbers meaningless: errors, or answers of the wrong length."""
    bad = [s.error for s in shots if s.error]
    bad += [f"{s.tokens} tokens (finish {s.finish}), expected {max_tokens}" for s in shots
            if not s.error and (s.tokens != max_tokens or s.t_first is None)]
    return bad


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def decode_tok_s(shots: list[Shot]) -> float | None:
    """Aggregate decode rate: tokens after each sequence's first, counted inside the window in which every
    sequence of the wave is past its first token (from the last first token to the last token). A sequence's
    decode tokens are spread evenly over its own [first, last]; a server that serialises the requests gets the
    rate of the one sequence decoding in that window, one that batches them gets the sum."""
    ok = [s for s in shots if s.t_first is not None and s.t_last is not None and s.tokens > 1]
    if not ok:
        return None
    a, b = max(s.t_first for s in ok), max(s.t_last for s in ok)   # type: ignore[type-var]
    if b <= a:
        return None
    toks = sum((s.tokens - 1) * _overlap(s.t_first, s.t_last, a, b) / (s.t_last - s.t_first)  # type: ignore[operator]
               for s in ok if s.t_last > s.t_first)  # type: ignore[operator]
    return toks / (b - a)


def output_tok_s(shots: list[Shot]) -> float | None:
    """Every completion token over the wave's wall time, prefill included."""
    ends = [s.t_last for s in shots if s.t_last is not None]
    if not ends:
        return None
    return sum(s.tokens for s in shots) / (max(ends) - min(s.t_send for s in shots))


def prefill_tok_s(shots: list[Shot], prompt_len: int) -> float | None:
    """Prompt tokens over the time until every sequence of the wave has its first token."""
    firsts = [s.t_first for s in shots if s.t_first is not None]
    if not shots or len(firsts) != len(shots):
        return None
    n = sum(s.prompt_tokens or prompt_len for s in shots)
    return n / (max(firsts) - min(s.t_send for s in shots))


def ttft_p50_ms(shots: list[Shot]) -> float | None:
    xs = sorted(s.t_first - s.t_send for s in shots if s.t_first is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return 1000 * (xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2)
