"""Each pool page's identity for the live pool's integrity checks (backend/engine/kv_integrity.py has the whole
story): a stamp drawn from one engine-wide counter each time the page is taken or freed uncached, its owner, its
sealed checksum; and the checks and failures counted by where. Kept by the BlockManager."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import numpy as np

log = logging.getLogger("edgeinfer.kv_integrity")
WHERE = ("step", "prefix_hit", "resume", "store_receive", "swap_in", "free", "handoff_send", "handoff_receive")
EXTERNAL = -1          # owner of a page fetched from an outer tier (or of a free page)


class PageLedger:
    """Per pool page: its stamp and owner (see the module docstring), its sealed checksum; and the counts of
    checks and failures by where."""

    def __init__(self, num_pages: int) -> None:
        self.stamp = np.zeros(num_pages, dtype=np.int64)      # 0: never taken
        self.owner = np.full(num_pages, EXTERNAL, dtype=np.int64)
        self.checksum: dict[int, int] = {}                    # sealed page -> checksum of its bytes
        self.checks: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.listeners: list[Callable[[str, str], None]] = []   # told of each failure (where, detail): tracing
        self._next = 1

    def _draw(self) -> int:
        s = self._next
        self._next += 1
        return s

    def take(self, page: int, owner: int) -> int:
        """page leaves the free list for `owner` (a sequence serial, or EXTERNAL); returns its new stamp."""
        s = self.stamp[page] = self._draw()
        self.owner[page] = owner
        self.checksum.pop(page, None)
        return s

    def retire(self, page: int) -> None:
        """page goes back to the free list uncached: whoever still names it with its old stamp is caught."""
        self.stamp[page] = self._draw()
        self.owner[page] = EXTERNAL
        self.checksum.pop(page, None)

    def fail(self, where: str, detail: str) -> None:
        self.failures[where] += 1
        log.warning("kv integrity failure (%s): %s; dropped, recomputing", where, detail)
        for listener in self.listeners:
            listener(where, detail)
