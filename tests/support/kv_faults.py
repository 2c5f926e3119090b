"""Fault injection into the live KV pool, for tests only (docs/RELIABILITY.md, "The live pool").

Each fault is a bug the engine's integrity checks (backend/engine/kv_integrity.py) must catch:
  corrupt_page        bytes of a live page overwritten (a stray write, a bad DMA);
  free_live_page      a page freed while its sequence still decodes, so the next allocation takes it
                      (SGLang PR 24063's bug);
  point_entry         a block-table entry pointed at another sequence's page;
  keep_stale_entries  prefix-cache entries kept after their page was evicted and reused (a phantom hit).

Off unless EDGEINFER_KV_FAULT_INJECTION=1 is set (KVFaults refuses to exist otherwise), and the backend and
serve commands refuse to start while it is set (edgeinfer.backend.fault_injection.refuse_in_production): no
deployment can carry it. Call the
faults on the engine thread (engine.call_in_engine) or while the engine is driven by the caller's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeinfer.backend.fault_injection import ENV, enabled

if TYPE_CHECKING:
    from edgeinfer.backend.engine.engine import LLMEngine
    from edgeinfer.backend.engine.sequence import Sequence

__all__ = ["ENV", "KVFaults", "enabled"]


class KVFaults:
    """The faults, applied to one engine."""

    def __init__(self, engine: LLMEngine) -> None:
        if not enabled():
            raise RuntimeError(f"KV fault injection is off: set {ENV}=1 (tests only)")
        self.engine = engine
        self.blocks = engine.blocks

    def corrupt_page(self, page: int, seed: int = 0) -> None:
        """Overwrite page's K and V in every layer (values, not scales) with large random values."""
        import torch  # this module stays torch-free at import: `edgeinfer serve` imports it before any model

        g = torch.Generator().manual_seed(seed)
        for kv in self.engine.runner.kv:
            for t in (kv.k, kv.v):
                if t is None:
                    continue
                noise = (torch.randn(t[page].shape, generator=g) * 8.0).to(t.dtype)
                t[page].copy_(noise.to(t.device))

    def free_live_page(self, seq: Sequence, index: int) -> int:
        """Release seq's page at `index` although seq still holds it; returns the page."""
        page = seq.block_table[index]
        self.blocks.release(page)
        return page

    def point_entry(self, seq: Sequence, index: int, page: int) -> None:
        """seq's table entry `index` (its Python list and its table row) names `page` instead."""
        seq.block_table[index] = page
        self.blocks.tables.array[seq.table_row, index] = page

    def keep_stale_entries(self) -> None:
        """From now on a page evicted from the prefix cache leaves its entry behind (pointing at the page, which
        is reused)."""
        blocks = self.blocks
        uncache = blocks._uncache_page

        def keep(page: int) -> bytes:
            h = blocks.hash_of_page[page]
            entry = blocks.cache[h]
            uncache(page)
            blocks.cache[h] = entry
            return h

        blocks._uncache_page = keep  # type: ignore[method-assign]
