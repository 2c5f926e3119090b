"""Fetching a prompt's pages from the page store before the request reaches the engine.

Prompt page hashes -> leading pages already in the local prefix cache -> the following pages from the tiers,
nearest first (host, then Redis: one pipeline per chunk of fetch_chunk_bytes) -> codec.decode each (MAC under
the page key) against what this engine expects (hash, parent, tokens, format) -> stop at the first miss.
An integrity failure is counted (integrity_failures{model,source}), logged with the page hash and tier,
deleted from that tier, and ends the fetch (the rest is recomputed). Verified pages go into the KV pool on the
engine thread (BlockManager.insert_external + write + release), so the scheduler's own prefix match then hits
them; with the engine's KV integrity on, each page's bytes in the pool are read back against the verified body
(kv_integrity_checks_total{where="swap_in"} from the host tier, "store_receive" from the others) and a page that
differs is dropped. Bounded by fetch_timeout_s; never fails the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from edgeinfer.backend.engine.kv_port import ExternalPage
from edgeinfer.backend.page_store.context import StoreContext, StorePart
from edgeinfer.cache_store.codec import DecodedPage, decode
from edgeinfer.protocol.page_id import page_hashes

log = logging.getLogger("edgeinfer.store_bridge")


class PageSource(Protocol):
    """Where pages are fetched from: the tiers (cache_store.store.TieredPageStore) or a prefill node
    (backend/page_store/handoff.py PeerPages). Per key: (blob, tier name) or None."""

    async def get_many_sourced(self, keys: Sequence[bytes],
                               timeout_s: float | None = None) -> list[tuple[bytes, str] | None]: ...

    async def delete_from(self, name: str, keys: Sequence[bytes]) -> None: ...


class PagePrefetcher(StorePart):
    def __init__(self, ctx: StoreContext, *, fetch_timeout_s: float, fetch_chunk_bytes: int) -> None:
        super().__init__(ctx)
        self.fetch_timeout_s = fetch_timeout_s
        self.fetch_chunk_pages = max(1, fetch_chunk_bytes // self.page_bytes)
        self._background: set[asyncio.Task] = set()

    async def prefetch(self, req) -> int:
        """Fetch, verify and upload the prompt's pages beyond the local cache. Returns pages uploaded."""
        if self.store is None or not self.port.prefix_cache or (req.tenant and not req.tenant.retain):
            return 0    # a no-retain tenant's prompts neither fetch nor (through the fetch) index anything
        t0 = time.monotonic()
        try:
            uploaded = await self.fetch_into_pool(req, self.store, t0 + self.fetch_timeout_s, self.fetch_chunk_pages)
        except Exception:  # noqa: BLE001 - the store never fails a request
            self.counters.count("errors")
            log.exception("page fetch failed for request %s; computing it instead", req.request_id)
            return 0
        finally:
            self.counters.fetch_took(time.monotonic() - t0)
        return uploaded

    async def fetch_into_pool(self, req, source: PageSource, deadline: float, chunk_pages: int) -> int:
        """The prompt's pages beyond the local cache from `source` (the tiers, or a prefill node's hand-off:
        backend/page_store/handoff.py), verified and written into the pool, chain order, up to the first miss or
        bad page. Returns pages uploaded; raises what the source raises."""
        ctx = self.port.key_context(req.cache_namespace)
        tokens = req.prompt_token_ids
        p = ctx.page_size
        usable = (len(tokens) - 1) // p      # the scheduler always computes >= 1 prompt token
        if usable <= 0:
            return 0
        root = ctx.root
        hashes = page_hashes(ctx, tokens[: usable * p])
        first = self.port.cached_prefix_len(hashes, tokens, root)   # a hint: the upload re-checks
        if first >= usable:
            return 0
        if source is self.store:
            self.counters.count("fetch_requests")
        uploads: list[asyncio.Future] = []
        i = first
        done = False
        while i < usable and not done:
            left = deadline - time.monotonic()
            if left <= 0:
                self.counters.count("fetch_timeouts")
                break
            keys = hashes[i:min(usable, i + chunk_pages)]
            good, bodies = await self._fetch_chunk(source, keys, hashes, tokens, i, root, left)
            if good:
                buf = np.empty((len(good), self.page_bytes), dtype=np.uint8)
                for r, body in enumerate(bodies):
                    buf[r] = np.frombuffer(body, dtype=np.uint8)
                fut = asyncio.ensure_future(self.port.call_in_engine(self.port.write_pages, good,
                                                                     torch.from_numpy(buf), root))
                await asyncio.sleep(0)        # lets the task queue its engine command now, in chain order
                uploads.append(fut)
            i += len(keys)
            if len(good) < len(keys):
                done = True
        uploaded = await self._await_uploads(uploads, deadline)
        if uploaded and source is self.store:
            self._held(hashes[first:first + uploaded], uploaded)
        return uploaded

    async def _fetch_chunk(self, source: PageSource, keys: list[bytes], hashes: list[bytes], tokens: list[int], i: int,
                           root: bytes, left: float) -> tuple[list[ExternalPage], list[memoryview]]:
        """The verified leading pages of one chunk (pages i, i+1, ...), up to the first miss or bad page."""
        p = self.format.page_size
        sourced = await source.get_many_sourced(keys, timeout_s=left)
        good: list[ExternalPage] = []
        bodies: list[memoryview] = []
        for j, got in enumerate(sourced):
            k = i + j
            h = hashes[k]
            if got is None:
                break
            blob, tier = got
            parent = hashes[k - 1] if k else root
            page_tokens = tokens[k * p:(k + 1) * p]
            res = decode(blob, self.format.expect(h, parent, page_tokens), self.page_key)
            if not isinstance(res, DecodedPage):
                self.published.forget(h)   # the store's copy is not ours: publish ours again once computed
                if res.integrity_failure:
                    await self._integrity_failure(source, h, tier, res)
                else:
                    self.counters.count("incompatible")
                    log.info("page %s from the %s tier is not usable here: %s (%s)", h.hex(), tier,
                             res.reason.label, res.detail)
                break
            good.append(ExternalPage(h, parent, tuple(page_tokens), tier))
            bodies.append(res.body)
        return good, bodies

    async def _await_uploads(self, uploads: list[asyncio.Future], deadline: float) -> int:
        uploaded = 0
        if uploads:
            left = max(deadline - time.monotonic(), 0.05)
            try:
                async with asyncio.timeout(left):
                    for n in await asyncio.gather(*uploads):
                        uploaded += n
            except TimeoutError:
                # the uploads are queued ahead of this request's admission, so they still land first
                self.counters.count("fetch_timeouts")
        return uploaded

    def _held(self, held: list[bytes], uploaded: int) -> None:
        self.counters.count("fetch_hit_requests")
        self.counters.count("uploaded", uploaded)
        for h in held:                 # already in the store: a drain need not publish them again
            self.published.remember(h)
        if self.index is not None:     # this node now holds them too (background; a hint for routing)
            task = asyncio.create_task(self.index.publish(self.model, self.node_id, held))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _integrity_failure(self, source: PageSource, h: bytes, tier: str, miss) -> None:
        self.counters.count("integrity_failures", source=tier)
        log.warning("integrity failure: page %s from the %s tier: %s (%s); deleted from %s, recomputing",
                    h.hex(), tier, miss.reason.label, miss.detail, tier)
        try:
            await source.delete_from(tier, [h])
        except Exception:  # noqa: BLE001
            log.exception("could not delete corrupt page %s from %s", h.hex(), tier)
