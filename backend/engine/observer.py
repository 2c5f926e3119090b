"""EngineObserver: the engine's hooks (metrics, the page store's publisher); the defaults do nothing. Called on the
engine thread."""

from __future__ import annotations

from typing import Any

from edgeinfer.backend.engine.sequence import Sequence


class EngineObserver:
    def on_step(self, engine: Any, batch, dt: float) -> None: ...      # engine: the LLMEngine (None batch: a refresh)
    def on_first_token(self, seq: Sequence, ttft: float) -> None: ...
    def on_token(self, seq: Sequence, itl: float) -> None: ...
    def on_finish(self, seq: Sequence) -> None: ...
    def on_pages_filled(self, seq: Sequence, pages: list[tuple[bytes, int]]) -> None: ...
