"""A sequence's speculation state (Sequence.spec) and the n-gram index an n-gram proposer keeps in it."""

from __future__ import annotations

from dataclasses import dataclass


class NgramIndex:
    """One sequence's n-grams (min_ngram..max_ngram) -> the end position of their latest occurrence."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0          # tokens of the sequence seen so far

    def update(self, ids: list[int]) -> None:
        """Index the n-grams ending at positions indexed..len(ids)-2 (the one ending at the last token is the
        query, indexed on the next update so that a proposal never matches itself)."""
        for end in range(max(self.indexed, 1), len(ids)):
            for n in range(self.lo, self.hi + 1):
                if end - n >= 0:
                    self.last[tuple(ids[end - n:end])] = end      # the n-gram ids[end-n:end]; continuation at end
        self.indexed = len(ids)

    def propose(self, ids: list[int], k: int) -> list[int]:
        for n in range(self.hi, self.lo - 1, -1):
            if len(ids) < n:
                continue
            end = self.last.get(tuple(ids[len(ids) - n:]))
            if end is not None:
                return ids[end:end + k]
        return []


@dataclass
class SpecState:
    """A sequence's speculation state (seq.spec)."""
    index: NgramIndex | None      # ngram drafts
    accepted: float = 1.0        # decayed count of accepted draft tokens (prior: 1 of 2)
    tried: float = 2.0           # decayed count of draft tokens decided (accepted, or the first rejected)
    last_verify: int = 0         # engine step of its last verify
    mtp: tuple[int, list[int]] | None = None   # the MTP layer's draft and the sequence length it follows

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried


