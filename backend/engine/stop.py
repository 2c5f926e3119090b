"""Finish conditions and text deltas: EOS / stop ids / stop strings (never split across chunks)."""

from __future__ import annotations

from edgeinfer.protocol.tokenizer import Tokenizer


class StopChecker:
    def __init__(self, tok: Tokenizer | None, stop: list[str], stop_ids: set[int], eos_ids: set[int],
                 ignore_eos: bool, prompt_ids: list[int]) -> None:
        self.detok = tok.detokenizer(prompt_ids) if tok is not None else None
        self.stop = [s for s in stop if s]
        self.stop_ids = set(stop_ids)
        self.eos_ids = set() if ignore_eos else set(eos_ids)
        self.pending = ""          # decoded text not yet emitted (might begin a stop string)
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_id: int) -> tuple[str, bool]:
        """Returns (text to emit, finished-by-stop)."""
        if token_id in self.eos_ids or token_id in self.stop_ids:
            return self.flush(), True
        if self.detok is None:
            return "", False
        self.pending += self.detok.push(token_id)
        if self.stop:
            cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, self.pending = self.pending[:cut], ""
                return text, True
            safe = len(self.pending) - self._held_suffix()
            text, self.pending = self.pending[:safe], self.pending[safe:]
            return text, False
        text, self.pending = self.pending, ""
        return text, False

    def _held_suffix(self) -> int:
        # longest suffix of pending that is a proper prefix of some stop string
        for n in range(min(self.hold, len(self.pending)), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        text = self.pending + (self.detok.flush() if self.detok is not None else "")
        self.pending = ""
        if self.stop:
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        return text
