"""Host mirror of every running sequence's block table: one int32 row per sequence that holds pages,
written as pages are added (never rebuilt from the Python lists each step), gathered per step by row; beside
it, the stamp each entry's page had when the sequence took it (backend/engine/kv_integrity.py checks them
against the pages' current stamps before every step; 0: no entry)."""

from __future__ import annotations

import numpy as np

from edgeinfer.backend.engine.sequence import Sequence


class BlockTables:
    def __init__(self, rows: int = 64, width: int = 64) -> None:
        if rows < 1 or width < 1:
            raise ValueError(f"BlockTables(rows={rows}, width={width}): both must be >= 1")
        self.array = np.zeros((rows, width), dtype=np.int32)   # [row, page index] -> page id (0 past the end)
        self.stamps = np.zeros((rows, width), dtype=np.int64)  # [row, page index] -> the page's stamp when taken
        self.free_rows: list[int] = list(range(rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self.array.shape[0]

    def _row(self, seq: Sequence) -> int:
        if seq.table_row < 0:
            if not self.free_rows:
                old = self.num_rows
                self.array = np.concatenate([self.array, np.zeros_like(self.array)])
                self.stamps = np.concatenate([self.stamps, np.zeros_like(self.stamps)])
                self.free_rows = list(range(2 * old - 1, old - 1, -1))
            seq.table_row = self.free_rows.pop()
        return seq.table_row

    def _fit(self, width: int) -> None:
        if width > self.array.shape[1]:
            grown = np.zeros((self.num_rows, max(width, 2 * self.array.shape[1])), dtype=np.int32)
            grown[:, : self.array.shape[1]] = self.array
            stamps = np.zeros(grown.shape, dtype=np.int64)
            stamps[:, : self.stamps.shape[1]] = self.stamps
            self.array, self.stamps = grown, stamps

    def set(self, seq: Sequence, pages: list[int], stamps: list[int]) -> None:
        """seq's table is exactly `pages` (admission), taken with `stamps`."""
        row = self._row(seq)
        self._fit(len(pages))
        self.array[row, : len(pages)] = pages
        self.stamps[row, : len(pages)] = stamps

    def append(self, seq: Sequence, start: int, pages: list[int], stamps: list[int]) -> None:
        """pages (taken with `stamps`) were appended to seq's table at index `start`."""
        row = self._row(seq)
        self._fit(start + len(pages))
        self.array[row, start:start + len(pages)] = pages
        self.stamps[row, start:start + len(pages)] = stamps

    def forget(self, seq: Sequence, index: int) -> None:
        """Entry `index` of seq's table no longer holds a page (an integrity failure: it is not released)."""
        if seq.table_row >= 0:
            self.stamps[seq.table_row, index] = 0

    def release(self, seq: Sequence) -> None:
        if seq.table_row >= 0:
            self.array[seq.table_row] = 0
            self.stamps[seq.table_row] = 0
            self.free_rows.append(seq.table_row)
            seq.table_row = -1

    def gather(self, seqs: list[Sequence], width: int) -> np.ndarray:
        """[len(seqs), max(width, 1)] int32: the first `width` pages of each sequence's table (a copy)."""
        rows = [s.table_row for s in seqs]
        width = max(width, 1)
        self._fit(width)
        return self.array[rows, :width]
