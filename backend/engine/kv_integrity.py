"""KV integrity inside the engine: a page in the wrong place is caught before it is read, dropped and recomputed.

The keyed MAC (cache_store/codec.py) guards a page whenever it crosses a boundary. The failures seen in
production are valid-looking pages in the wrong place inside one engine (SGLang PR 24063: a page freed while
its request still decoded, reused by a concurrent prefill; phantom prefix hits after eviction; a wrong
block-table entry). Three things guard the live pool here (docs/RELIABILITY.md, "The live pool"):

Identity (PageLedger, kept by the BlockManager). Every pool page carries a stamp and an owner. The stamp is a
number drawn from one engine-wide counter each time the page is taken from the free list and each time it goes
back to it uncached, so a (page, stamp) pair names one tenancy of one page and is never reused; the owner is
the serial of the sequence that took it (-1: fetched from an outer tier, or free). A sequence records the stamp
of every page it takes (Sequence.page_stamps, mirrored beside its block-table row in BlockTables.stamps), and a
prefix-cache entry records the stamp its page had when it was sealed (CachedPage.stamp), beside the page hash
the ledger keeps for a sealed page (BlockManager.hash_of_page). Checked:
  step           before every forward pass, every entry of every scheduled sequence's table (one vectorized
                 compare of the recorded stamps with the pages' stamps), and the page each sequence writes this
                 step against its Python table;
  prefix_hit     each page a new request takes from the prefix cache: the entry's stamp and the page's sealed
  resume         hash (a resume after preemption takes its own sealed pages back the same way);
  store_receive  each page written into the pool from the page store (swap_in: from its host tier): the pool's
  swap_in        bytes read back against the received body;
  free           each page a finishing sequence gives back (a page already freed under it is not freed twice).
A failure is counted (kv_integrity_failures_total{where}), logged, and the page is dropped: a stale prefix
entry leaves the cache, a sequence whose table is wrong gives back the pages it still holds and is recomputed
from its tokens (output so far kept; recompute is exact: tests/backend/engine/test_batch_invariance.py). A request
never ends because of it.

Content (KVIntegrity.seal / verify). When a page is sealed, a 64-bit checksum of its bytes in the pool is
recorded: on CPU xxh3-64 over the page's bytes in every layer (read in place, no copy), on CUDA the page is
hashed on the device by kernels/page_checksum.py (its torch reference on CPU). When another request reuses the
page through the prefix cache, a fraction `kv_verify_fraction` of the pages it takes are hashed again and
compared (1.0 by default: the measured cost, benchmarks/engine/kv_integrity.py, is under the 2 % of decode at
32 sequences the issue allowed).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from edgeinfer import kernels
from edgeinfer.backend.engine.page_ledger import EXTERNAL, WHERE, PageLedger  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from edgeinfer.backend.engine.block_manager import BlockManager
    from edgeinfer.backend.engine.model_runner import ModelRunner
    from edgeinfer.backend.engine.sequence import Sequence


class KVIntegrity:
    """The engine's checks over its pool: identity before each step, checksums at seal and reuse."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, verify_fraction: float = 1.0,
                 seed: int = 0) -> None:
        self.runner = runner
        self.blocks = blocks
        self.ledger = blocks.ledger
        self.verify_fraction = verify_fraction
        self._rng = random.Random(seed)
        self._np_parts: list[np.ndarray] | None = None
        self._device_sums = runner.model.device.type == "cuda" and runner.page_io.world == 1

    # ---- checksums
    def _parts(self) -> list[np.ndarray]:
        if self._np_parts is None:
            self._np_parts = [t.reshape(t.shape[0], -1).numpy() for t in self.runner.page_io.parts()]
        return self._np_parts

    def checksums(self, pages: list[int]) -> list[int]:
        """The checksum of each pool page's bytes (body order: backend/page_store/bridge.py's page layout)."""
        if not pages:
            return []
        io = self.runner.page_io
        if self._device_sums:
            return kernels.page_checksum(io.read_on_device(pages)).tolist()
        if io.world > 1:                                     # a tensor-parallel node: every rank's share
            return body_checksums(io.read(pages))
        parts = self._parts()
        out = []
        for pg in pages:
            h = xxhash.xxh3_64()
            for a in parts:
                h.update(a[pg])
            out.append(h.intdigest())
        return out

    def body_checksums(self, buf: torch.Tensor) -> list[int]:
        """The checksums of page bodies [n, page_bytes] (host uint8), as checksums() gives for them in the pool."""
        if self._device_sums:
            return kernels.page_checksum(buf.to(self.runner.model.device).contiguous()).tolist()
        return body_checksums(buf)

    def seal(self, pages: list[int]) -> None:
        """Record the checksum of newly sealed pages."""
        for pg, s in zip(pages, self.checksums(pages)):
            self.ledger.checksum[pg] = s

    def verify(self, pages: list[int], hashes: list[bytes], where: str) -> int:
        """How many leading `pages` (sealed, about to be reused) pass the content check; the first that fails is
        dropped from the prefix cache. A page without a recorded checksum (sealed while checks were off) passes;
        a fraction kv_verify_fraction of the pages are hashed."""
        if self.verify_fraction <= 0.0 or not pages:
            return len(pages)
        picked = [i for i, pg in enumerate(pages) if pg in self.ledger.checksum
                  and (self.verify_fraction >= 1.0 or self._rng.random() < self.verify_fraction)]
        if not picked:
            return len(pages)
        got = self.checksums([pages[i] for i in picked])
        for i, s in zip(picked, got):
            if s != self.ledger.checksum[pages[i]]:
                self.ledger.fail(where, f"page {pages[i]} (hash {hashes[i].hex()[:16]}) changed since it was sealed")
                self.blocks.drop_cached(hashes[i])
                return i
        return len(pages)

    def received(self, pages: list[int], hashes: list[bytes], buf: torch.Tensor, where: list[str]) -> int:
        """Pages just written from the page store (buf: their bodies, host uint8): the pool's bytes must be the
        body's. Records their checksums; returns how many leading pages are good (the first bad one and the rest
        are dropped from the prefix cache by the caller)."""
        want = self.body_checksums(buf)
        got = self.checksums(pages)
        for i, (pg, a, b) in enumerate(zip(pages, got, want)):
            self.ledger.checks[where[i]] += 1
            if a != b:
                self.ledger.fail(where[i], f"page {pg} (hash {hashes[i].hex()[:16]}) holds other bytes than the "
                                           f"verified body written into it")
                return i
            self.ledger.checksum[pg] = a
        return len(pages)

    # ---- identity before a step
    def check_batch(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """(sequence, indexes of its bad table entries) for each scheduled sequence that names a page it does not
        hold, or whose Python table and table row disagree on the page it writes this step."""
        if not seqs:
            return []
        tables, ledger, p = self.blocks.tables, self.ledger, self.blocks.page_size
        rows = np.asarray([s.table_row for s in seqs])
        width = max(len(s.block_table) for s in seqs)
        pages = tables.array[rows, :width]
        want = tables.stamps[rows, :width]
        held = want != 0
        bad = held & (ledger.stamp[pages] != want)
        writes = np.asarray([min(s.num_computed_tokens // p, len(s.block_table) - 1) for s in seqs])
        py = np.asarray([s.block_table[j] for s, j in zip(seqs, writes)])
        torn = py != pages[np.arange(len(seqs)), writes]
        ledger.checks["step"] += int(held.sum())
        if not bad.any() and not torn.any():
            return []
        out = []
        for r, s in enumerate(seqs):
            idx = sorted(set(np.flatnonzero(bad[r]).tolist()) | ({int(writes[r])} if torn[r] else set()))
            if not idx:
                continue
            for i in idx:
                pg = int(pages[r, i])
                ledger.fail("step", f"request {s.request_id} entry {i} names page {pg} with stamp {int(want[r, i])}; "
                                    f"the page has stamp {int(ledger.stamp[pg])} (owner {int(ledger.owner[pg])})")
            out.append((s, idx))
        return out


def body_checksums(buf: torch.Tensor) -> list[int]:
    """xxh3-64 of each row of a host uint8 [n, page_bytes] tensor."""
    a = buf.contiguous().numpy()
    return [xxhash.xxh3_64_intdigest(a[i]) for i in range(a.shape[0])]
