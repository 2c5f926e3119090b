"""Prefill/decode disaggregation, the backend's side (docs/DISAGGREGATION.md): a prefill node's sealed pages handed
to a decode node directly, node to node over the internal API.

Prefill node: a request with `prefill_only` runs as a one-token request (backend.server answers one "prefilled"
chunk: no token, the usage). Its full prompt pages stay in the prefix cache; `send` answers POST
/internal/kv/pages: the leading pages of the asked chain that the pool holds, read on the engine thread after
their sealed checksums are checked (KVPort.read_sealed: a page that changed since sealing is dropped, never sent),
each sealed with the page key (cache_store.codec: keyed MAC over header + body) and framed as a 4-byte
little-endian length + blob, up to the first page not held.

Decode node: a request naming a `kv_source` first pulls the prompt's pages beyond its local prefix from that node
(`receive`, bounded by --handoff-timeout), through the page-store prefetcher's own path: each blob decoded against
what this engine expects at that position of the chain (MAC under the page key, page hash, parent hash, token
ids, format), written into the pool and read back against the verified body (kv_integrity `handoff_receive`),
stopping at the first miss or bad page. Whatever did not come (a dead or stuck prefill node, evicted pages, a
failed check) is fetched from the page store's tiers next, or computed: the hand-off never fails a request.

Nothing is leased: the prefill node's pages are ordinary cached pages (reference count 0, evictable) between the
two hops, so a cancelled or abandoned hand-off holds nothing on either node. The window is the gateway's second
hop (milliseconds); a page evicted in it is recomputed on the decode node.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
import msgspec
from prometheus_client import Counter

from edgeinfer.backend.page_store.context import StoreContext, StorePart
from edgeinfer.backend.page_store.prefetch import PagePrefetcher
from edgeinfer.cache_store.codec import encode
from edgeinfer.cache_store.node_auth import NodeRecordKey
from edgeinfer.cache_store.registry import NodeRegistry
from edgeinfer.protocol.wire import KVPagesRequest, KVSource

log = logging.getLogger("edgeinfer.handoff")
_FRAME = struct.Struct("<I")
PEER_TIER = "peer"          # ExternalPage.source of a handed-off page (kv_port.RECEIVED_AS -> "handoff_receive")
HANDOFF_EVENTS = ("sent", "received", "rejected", "pulls", "pull_failures", "pull_timeouts", "pull_refused")
SEND_BATCH_PAGES = 16       # pages read from the pool, sealed and written per step of a /internal/kv/pages answer


BLOB_SLACK = 64 << 10      # a sealed page's bytes beyond its body: envelope, header (tokens, fields), salt and MAC


class PeerPages:
    """A prefill node as a page source (prefetch.PageSource): one POST per chunk of keys. Its answer is read frame
    by frame with every size checked before it is buffered: at most one frame per key asked, each at most
    `max_blob` bytes (a page's body + BLOB_SLACK); a frame over that, or bytes past the last frame asked, end the
    read (HandoffFailed: the hop fails, this node computes), so a broken or hostile node cannot grow our memory."""

    def __init__(self, session: aiohttp.ClientSession, source: KVSource, headers: dict[str, str],
                 max_blob: int) -> None:
        self.session = session
        self.source = source
        self.url = source.url.rstrip("/") + "/internal/kv/pages"
        self.headers = headers
        self.max_blob = max_blob
        self.rejected = 0            # pages that failed verification (the prefetcher reports each here)

    async def get_many_sourced(self, keys: Sequence[bytes],
                               timeout_s: float | None = None) -> list[tuple[bytes, str] | None]:
        body = msgspec.json.encode(KVPagesRequest(list(keys)))
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.post(self.url, data=body, headers=self.headers, timeout=timeout) as r:
            if r.status != 200:
                raise HandoffFailed(f"prefill node {self.source.node_id}: HTTP {r.status}: "
                                    f"{(await r.content.read(200)).decode(errors='replace')}")
            declared = r.content_length
            if declared is not None and declared > len(keys) * (self.max_blob + _FRAME.size):
                raise HandoffFailed(f"prefill node {self.source.node_id}: an answer of {declared} bytes for "
                                    f"{len(keys)} pages of at most {self.max_blob} bytes")
            try:
                blobs = await read_frames(r.content, len(keys), self.max_blob)
            except FrameError as e:
                raise HandoffFailed(f"prefill node {self.source.node_id}: {e}") from e
        return [(b, PEER_TIER) for b in blobs] + [None] * (len(keys) - len(blobs))

    async def delete_from(self, name: str, keys: Sequence[bytes]) -> None:
        """A page that failed verification: not ours to delete on the prefill node; counted, dropped, recomputed."""
        self.rejected += len(keys)


class FrameError(Exception):
    """A /internal/kv/pages answer that breaks its bounds: a frame over a page's size, or bytes past the pages
    asked."""


async def read_frames(stream: asyncio.StreamReader | aiohttp.StreamReader, limit: int, max_blob: int) -> list[bytes]:
    """The blobs of a /internal/kv/pages answer (each a 4-byte little-endian length, then the blob), read from
    `stream` with every size checked before it is buffered: at most `limit` frames, each at most `max_blob` bytes.
    A truncated last frame ends the read (a miss); a frame over `max_blob`, or bytes after `limit` frames, is a
    FrameError."""
    blobs: list[bytes] = []
    while len(blobs) < limit:
        try:
            head = await stream.readexactly(_FRAME.size)
        except asyncio.IncompleteReadError:
            return blobs      # the end (or a truncated frame length): the pages so far, the rest missed
        (n,) = _FRAME.unpack(head)
        if n > max_blob:
            raise FrameError(f"a frame of {n} bytes; a page is at most {max_blob}")
        try:
            blobs.append(await stream.readexactly(n))
        except asyncio.IncompleteReadError:
            return blobs
    if await stream.read(1):
        raise FrameError(f"bytes past the {limit} pages asked")
    return blobs


class HandoffFailed(Exception):
    """The prefill node answered the page request with an error."""


class HandoffCounters:
    """edgeinfer_backend_kv_handoff_pages_total{direction=sent|received|rejected} and
    edgeinfer_backend_kv_handoff_pulls_total{outcome=ok|failed|timeout|refused} (with backend metrics); `stats`
    always."""

    def __init__(self, model: str, metrics=None) -> None:
        self.model = model
        self.stats: dict[str, int] = dict.fromkeys(HANDOFF_EVENTS, 0)
        self._pages = self._pulls = None
        if metrics is not None:
            self._pages = Counter("edgeinfer_backend_kv_handoff_pages",
                                  "KV pages handed from a prefill node to a decode node: sent (prefill side), "
                                  "received (verified and written, decode side), rejected (failed verification)",
                                  ["model", "direction"], registry=metrics.registry)
            self._pulls = Counter("edgeinfer_backend_kv_handoff_pulls",
                                  "Decode-side pulls of a prompt's pages from its prefill node, by outcome",
                                  ["model", "outcome"], registry=metrics.registry)
            for direction in ("sent", "received", "rejected"):     # known label values at 0 from the start
                self._pages.labels(model, direction)
            for outcome in ("ok", "failed", "timeout", "refused"):
                self._pulls.labels(model, outcome)

    def pages(self, direction: str, n: int) -> None:
        self.stats[direction] += n
        if self._pages is not None and n:
            self._pages.labels(self.model, direction).inc(n)

    def pull(self, outcome: str) -> None:
        key = {"ok": "pulls", "failed": "pull_failures", "timeout": "pull_timeouts", "refused": "pull_refused"}[outcome]
        self.stats[key] += 1
        if self._pulls is not None:
            self._pulls.labels(self.model, outcome).inc()


class KVHandoff(StorePart):
    def __init__(self, ctx: StoreContext, prefetcher: PagePrefetcher, *, timeout_s: float,
                 internal_secret: str | None, metrics=None, chunk_bytes: int = 96 << 20,
                 peers: Sequence[str] = (), registry: NodeRegistry | None = None) -> None:
        super().__init__(ctx)
        self.prefetcher = prefetcher
        self.timeout_s = timeout_s
        self.chunk_pages = max(1, chunk_bytes // self.page_bytes)
        self.headers = {"authorization": f"Bearer {internal_secret}"} if internal_secret else {}
        self.verifier = NodeRecordKey(internal_secret) if internal_secret else None
        self.peers = frozenset(u.rstrip("/") for u in peers)
        self.registry = registry
        self.handoff = HandoffCounters(self.model, metrics)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------ prefill side
    async def send(self, hashes: list[bytes]) -> AsyncIterator[bytes]:
        """The sealed pages this pool holds of the chain `hashes` (leading run, each page's parent the hash before
        it), each framed as the length (4 bytes) and the blob, SEND_BATCH_PAGES pages at a time: read on the engine
        thread, sealed, yielded for the response to write; the answer is never built whole in memory."""
        prev: bytes | None = None
        fmt = self.format
        for start in range(0, len(hashes), SEND_BATCH_PAGES):
            part = hashes[start:start + SEND_BATCH_PAGES]
            held, buf = await self.port.call_in_engine(self.port.read_sealed, part)
            if not held or buf is None or (prev is not None and held[0][1].parent != prev):
                return
            rows = buf.numpy()
            for j, (h, hit) in enumerate(held):
                blob = encode(fmt.header(h, hit.parent, hit.tokens), rows[j], self.page_key)
                yield _FRAME.pack(len(blob))
                yield blob
            self.handoff.pages("sent", len(held))
            if len(held) < len(part):
                return
            prev = held[-1][0]

    # ------------------------------------------------------------ decode side
    async def known_peer(self, source: KVSource) -> bool:
        """Whether `source` names a node this one may send the internal secret to: a URL of --handoff-peers, or a
        prefill node's signed, current record in the registry (same node id and URL). Never a URL only because a
        request names it."""
        url = source.url.rstrip("/")
        if url in self.peers:
            return True
        if self.registry is None or self.verifier is None:
            return False
        for rec in await self.registry.list_nodes():
            if rec.node_id == source.node_id and rec.url.rstrip("/") == url and rec.role in ("prefill", "both") \
                    and self.verifier.refusal(rec) is None:
                return True
        return False

    async def receive(self, req) -> int:
        """Pull the prompt's pages beyond the local prefix from req.kv_source. Returns pages written; never raises."""
        source: KVSource | None = req.kv_source
        if source is None or not self.port.prefix_cache or self._session is None or (req.tenant and not req.tenant.retain):
            return 0    # a no-retain tenant's pages are never cached, so a prefill node holds none to hand over
        if not await self.known_peer(source):
            self.handoff.pull("refused")
            log.warning("request %s: kv_source %s (%s) is not a known prefill node (--handoff-peers, the signed "
                        "registry); not pulled, computing the prompt", req.request_id, source.node_id, source.url)
            return 0
        t0 = time.monotonic()
        peer = PeerPages(self._session, source, self.headers, self.page_bytes + BLOB_SLACK)
        try:
            got = await self.prefetcher.fetch_into_pool(req, peer, t0 + self.timeout_s, self.chunk_pages)
        except TimeoutError:
            self.handoff.pull("timeout")
            log.warning("request %s: pulling its pages from prefill node %s took over %.1fs; computing the rest",
                        req.request_id, source.node_id, self.timeout_s)
            return 0
        except Exception as e:  # noqa: BLE001 - a hand-off never fails the request
            self.handoff.pull("failed")
            log.warning("request %s: pulling its pages from prefill node %s failed (%s: %s); computing the rest",
                        req.request_id, source.node_id, type(e).__name__, e)
            return 0
        finally:
            self.handoff.pages("rejected", peer.rejected)
        self.handoff.pages("received", got)
        self.handoff.pull("ok")
        log.debug("request %s: %d pages from prefill node %s in %.1f ms", req.request_id, got, source.node_id,
                  (time.monotonic() - t0) * 1e3)
        return got
