"""Backend nodes as the gateway sees them: where they are, whether they answer, how busy they are.

Sources: static `[[nodes]]` from config, and/or the shared registry (cache_store.registry) when Redis
is configured. Each node has its own probe loop (/ready, and /internal/info once per version), so a
hung node slows nobody else's probes. A probe unanswered after `probe_timeout_s` fails: the node is
not routable, and every request still waiting for its first byte on it is moved (see `Node.watchers`,
gateway.upstream) when another node can take it. A node whose last answer is older than
`stale_after_s` is not routable either. A node that fails a request is marked down at once (passive
check) until a probe succeeds again.

With an internal secret, a registry record is believed only when signed by a holder of that secret and
not expired (cache_store.node_auth): Redis is untrusted, and the gateway sends its secret and tenants'
prompts to the nodes in its pool. A refused record is ignored (counted, logged once per node id); a node
already in the pool under that id is neither updated nor replaced by it. Without a secret every record is
believed (insecure backends: there is nothing to sign with).

Ages are read on the pool's `LoopClock`, which does not count time the gateway's own event loop was stalled
(a long synchronous step in a handler): a node is judged by how long it went unanswered while the gateway
could have heard it, so a stalled gateway does not mark its healthy nodes dead, and a probe whose timeout
fired because the loop stalled is inconclusive, not a failure.

A registry node that the listing misses (Redis restarted empty, a listing failed) stays: it leaves
only when its own probe fails, when another id lists its URL, or after `forget_after_s` unlisted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
import msgspec

from edgeinfer.cache_store.node_auth import NodeRecordKey
from edgeinfer.cache_store.registry import NodeRecord
from edgeinfer.protocol.wire import BackendInfo, info_decoder

if TYPE_CHECKING:
    from prometheus_client import Counter

log = logging.getLogger(__name__)
_NO_ANSWER = (TimeoutError, aiohttp.ClientConnectionError, OSError)


class LoopClock:
    """time.monotonic() less the time this event loop was stalled: `run` ticks every `tick_s`; a tick that
    comes late by more than `slack_s` counts its lateness as stalled, and so does the lateness of the tick
    still due when `now()` is read (the loop has just come back from a stall it has not ticked through).
    While `run` is not running it is time.monotonic()."""

    def __init__(self, tick_s: float = 0.05, slack_s: float = 0.05) -> None:
        self.tick_s, self.slack_s = tick_s, slack_s
        self.last = time.monotonic()
        self.stalled_s = 0.0
        self.running = False

    def _late(self, t: float) -> float:
        late = t - self.last - self.tick_s
        return late if self.running and late > self.slack_s else 0.0

    def stalled(self) -> float:
        """Seconds stalled so far, the stall not yet ticked through included."""
        return self.stalled_s + self._late(time.monotonic())

    def now(self) -> float:
        t = time.monotonic()
        return t - self.stalled_s - self._late(t)

    async def run(self) -> None:
        self.last, self.running = time.monotonic(), True
        try:
            while True:
                await asyncio.sleep(self.tick_s)
                t = time.monotonic()
                self.stalled_s += self._late(t)
                self.last = t
        finally:
            self.running = False


@dataclass(eq=False)
class Node:
    node_id: str
    url: str
    model: str
    state: str = "active"          # "active" | "draining" (registry or /internal/info)
    ready: bool = False            # last /ready probe answered 200
    info: BackendInfo | None = None
    inflight: int = 0              # requests this gateway has open on the node
    reported_load: int = 0         # running + waiting from the registry heartbeat
    kv_usage: float = 0.0          # KV pages in use / pages, from the last /ready answer
    prefill_queued: int = 0        # prompt tokens waiting to be prefilled, from the last /ready answer
    ttft_estimate_s: float = 0.0   # the node's estimated wait for a new request's first token (/ready queue_wait_s)
    prefill_pending: int = 0       # prompt tokens this gateway has sent it to prefill and not yet had answered
    down_until: float = 0.0        # passive health: set when a request failed
    static: bool = True
    version: str = ""
    answered_at: float = -math.inf  # monotonic time of the last probe the node answered (any status)
    stale_after_s: float = math.inf  # set by the pool: an older last answer makes the node unroutable
    probe_failed: bool = False     # the last probe got no answer or no 200
    listed_at: float = field(default_factory=time.monotonic)  # registry nodes: the last listing holding it
    clock: LoopClock = field(default_factory=LoopClock, repr=False)   # the pool's: answered_at is on it
    # the first-byte waits on this node (gateway.upstream): expired at once when a probe goes unanswered
    watchers: set[asyncio.Timeout] = field(default_factory=set, repr=False)
    generate_url: str = field(init=False)
    abort_url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.generate_url = self.url + "/internal/generate"
        self.abort_url = self.url + "/internal/abort"

    @property
    def answer_age(self) -> float:
        return self.clock.now() - self.answered_at

    @property
    def answering(self) -> bool:
        return self.answer_age <= self.stale_after_s

    @property
    def routable(self) -> bool:
        return (self.ready and self.info is not None and self.state == "active"
                and self.down_until <= time.monotonic() and self.answering)

    @property
    def role(self) -> str:
        """prefill | decode | both (the backend's --role, from /internal/info)."""
        return self.info.role if self.info is not None else "both"

    @property
    def load(self) -> int:
        return self.inflight + self.reported_load

    def mark_failed(self, cooldown_s: float = 2.0) -> None:
        self.down_until = time.monotonic() + cooldown_s
        self.ready = False

    def stopped_answering(self) -> int:
        """Expire every first-byte wait on this node now; returns how many there were."""
        waits, self.watchers = self.watchers, set()
        now = asyncio.get_running_loop().time()
        for w in waits:
            if not w.expired():
                w.reschedule(now)
        return len(waits)


_load_decoder = msgspec.json.Decoder(dict)


def _read_load(node: Node, body: bytes) -> None:
    """KV occupancy and queued prefill tokens from a /ready answer (backend.server.load_report); a body without
    them (an older backend) leaves the last values."""
    try:
        report = _load_decoder.decode(body)
        used, total = report.get("kv_pages_used"), report.get("kv_pages_total")
        if isinstance(used, int) and isinstance(total, int) and total > 0:
            node.kv_usage = min(1.0, max(0.0, used / total))
        queued = report.get("prefill_tokens_queued")
        if isinstance(queued, int) and queued >= 0:
            node.prefill_queued = queued
        wait = report.get("queue_wait_s")
        if isinstance(wait, int | float) and wait >= 0:
            node.ttft_estimate_s = float(wait)
        elif "queue_wait_s" in report and wait is None:     # no estimate yet (no step fitted): nothing queued
            node.ttft_estimate_s = 0.0
    except msgspec.DecodeError:
        pass


class NodePool:
    def __init__(self, session_getter, static: list[Node], registry=None, interval_s: float = 1.0,
                 stale_intervals: int = 3, forget_after_s: float = 60.0, record_key: NodeRecordKey | None = None,
                 refused: Counter | None = None) -> None:
        self._session = session_getter
        self.registry = registry
        self.interval_s = interval_s
        # a hung node's probe fails (stale_intervals - 1) intervals after it was sent, i.e. when the
        # node's last answer is stale_intervals intervals old (the 0.5 s floor spares a busy loopback)
        self.probe_timeout_s = max(0.5, (stale_intervals - 1) * interval_s)
        self.stale_after_s = interval_s + self.probe_timeout_s
        self.forget_after_s = forget_after_s
        self.record_key = record_key
        self._refused_metric = refused
        self._refusals_logged: set[str] = set()
        self.clock = LoopClock()
        self.nodes: dict[str, Node] = {}
        for n in static:
            self._adopt(n)
        self._loops: dict[str, tuple[Node, asyncio.Task]] = {}

    def _adopt(self, node: Node) -> Node:
        node.stale_after_s = self.stale_after_s
        node.clock = self.clock
        self.nodes[node.node_id] = node
        return node

    def for_model(self, model: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.model == model and n.routable]

    def models(self) -> set[str]:
        return {n.model for n in self.nodes.values()}

    async def _sync_registry(self) -> None:
        records = await self.registry.list_nodes()
        now = time.monotonic()
        seen = set()
        for r in records:
            if not self._believed(r):
                continue
            seen.add(r.node_id)
            node = self.nodes.get(r.node_id)
            if node is None or node.url != r.url.rstrip("/") or node.version != r.version:
                node = self._adopt(Node(r.node_id, r.url, r.model, static=False, version=r.version))
            node.state = r.state
            node.reported_load = r.running + r.waiting
            node.listed_at = now
        listed_urls = {self.nodes[i].url for i in seen}
        for node in [n for i, n in self.nodes.items() if not n.static and i not in seen]:
            if node.url in listed_urls:
                why = "another node id is listed at its URL"
            elif node.probe_failed:
                why = "unlisted and its probe failed"
            elif now - node.listed_at > self.forget_after_s:
                why = f"unlisted for {now - node.listed_at:.0f}s"
            else:
                continue   # e.g. Redis restarted empty: keep it until it re-registers or stops answering
            log.info("node %s (%s) leaves the pool: %s", node.node_id, node.url, why)
            del self.nodes[node.node_id]

    def _believed(self, r: NodeRecord) -> bool:
        why = None if self.record_key is None else self.record_key.refusal(r)
        if why is None:
            self._refusals_logged.discard(r.node_id)
            return True
        if self._refused_metric is not None:
            self._refused_metric.labels(why).inc()
        if r.node_id not in self._refusals_logged and len(self._refusals_logged) < 1024:
            self._refusals_logged.add(r.node_id)
            log.warning("registry record of node %r (%r) refused: %s (expires_at %.1f, now %.1f); not probed, "
                        "not routed to", r.node_id, r.url, why, r.expires_at, time.time())
        return False

    async def probe(self, node: Node) -> None:
        session: aiohttp.ClientSession = self._session()
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        stalled_before = self.clock.stalled()
        try:
            async with session.get(node.url + "/ready", timeout=timeout) as r:
                ready = r.status == 200
                if ready:
                    _read_load(node, await r.read())
            node.answered_at = self.clock.now()
            if ready and node.info is None:  # /ready answers 503 while draining; info is fixed per version
                async with session.get(node.url + "/internal/info", timeout=timeout) as r:
                    r.raise_for_status()
                    node.info = info_decoder.decode(await r.read())
            was = node.ready
            node.ready = ready
            node.probe_failed = not ready
            if ready:
                node.down_until = 0.0
            if was != ready:
                log.info("node %s (%s) is %s", node.node_id, node.url, "ready" if ready else "not ready")
        except (*_NO_ANSWER, aiohttp.ClientError, msgspec.MsgspecError) as e:
            if isinstance(e, TimeoutError) and self.clock.stalled() - stalled_before > self.probe_timeout_s / 2:
                log.info("probe of node %s timed out while this gateway's event loop was stalled (%.1f s): "
                         "inconclusive", node.node_id, self.clock.stalled() - stalled_before)
                return
            if node.ready:
                log.warning("node %s (%s) probe failed: %s: %s", node.node_id, node.url, type(e).__name__, e)
            node.ready = False
            node.probe_failed = True
            if isinstance(e, _NO_ANSWER) and node.watchers:
                self._move_waiters(node)

    def _move_waiters(self, node: Node) -> None:
        """Move the requests waiting on `node` for their first byte, if another node can take them
        (with none, moving would turn a slow answer into a 503: they keep waiting, and the next
        unanswered probe tries again)."""
        if not self.for_model(node.model):
            log.warning("node %s (%s) stopped answering; %d request(s) keep waiting on it: no other node "
                        "serves %s", node.node_id, node.url, len(node.watchers), node.model)
            return
        log.warning("node %s (%s) stopped answering; moving %d request(s) waiting for their first byte",
                    node.node_id, node.url, node.stopped_answering())

    async def _probe_loop(self, node: Node) -> None:
        while True:
            try:
                await self.probe(node)
            except Exception:  # noqa: BLE001 - the loop must outlive a bug in one probe
                log.exception("probe of node %s failed", node.node_id)
                node.ready = False
            await asyncio.sleep(self.interval_s)

    def _supervise(self) -> None:
        """One probe loop per node in the pool: start the missing (or dead) ones, end the departed."""
        for node_id, (node, task) in list(self._loops.items()):
            if self.nodes.get(node_id) is not node:
                task.cancel()
                del self._loops[node_id]
        loop = asyncio.get_running_loop()
        for node in self.nodes.values():
            entry = self._loops.get(node.node_id)
            if entry is None or entry[1].done():
                self._loops[node.node_id] = (node, loop.create_task(self._probe_loop(node)))

    async def _sync(self) -> None:
        if self.registry is not None:
            try:
                await self._sync_registry()
            except Exception as e:
                log.warning("registry listing failed: %s: %s", type(e).__name__, e)

    async def refresh(self) -> None:
        """Sync the registry and probe every node once (at start, before serving)."""
        await self._sync()
        await asyncio.gather(*(self.probe(n) for n in list(self.nodes.values())))

    async def run(self) -> None:
        clock = asyncio.get_running_loop().create_task(self.clock.run())
        try:
            while True:
                await self._sync()
                self._supervise()
                await asyncio.sleep(self.interval_s)
        finally:
            tasks = [clock, *(t for _, t in self._loops.values())]
            self._loops.clear()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
