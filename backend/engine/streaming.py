"""The engine's stream plumbing on the asyncio side: keepalives while a request waits on a working node."""

from __future__ import annotations

import asyncio
from typing import Any


class Keepalive:
    """Puts a None (keepalive) into a stream's queue after `every_s` without output, if the engine stepped
    since the stream's last output: one loop timer per stream, moved only when it fires."""

    __slots__ = ("loop", "q", "every_s", "engine", "last", "seen_steps", "handle")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, every_s: float, engine: Any) -> None:
        self.loop, self.q, self.every_s, self.engine = loop, q, every_s, engine
        self.last = loop.time()
        self.seen_steps = engine.steps
        self.handle = loop.call_at(self.last + every_s, self._fire)

    def saw_output(self) -> None:
        """The stream passed on a chunk or a keepalive: the silence starts again."""
        self.last = self.loop.time()
        self.seen_steps = self.engine.steps

    def _fire(self) -> None:
        now = self.loop.time()
        due = self.last + self.every_s
        if now < due:
            self.handle = self.loop.call_at(due, self._fire)
            return
        if self.engine.steps != self.seen_steps:
            self.seen_steps = self.engine.steps
            self.q.put_nowait(None)
        self.last = now
        self.handle = self.loop.call_at(now + self.every_s, self._fire)

    def cancel(self) -> None:
        self.handle.cancel()
