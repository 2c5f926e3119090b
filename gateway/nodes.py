"""Backend nodes as the gateway sees them: where they are, whether they answer, how busy they are.

Sources: static `[[nodes]]` from config, and/or the shared registry (cache_store.registry) when Redis
is configured. A background loop probes each node's /ready and /internal/info; a node that fails a
request is marked down at once (passive check) until a probe succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from backend.protocol import BackendInfo, info_decoder

log = logging.getLogger(__name__)


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
    down_until: float = 0.0        # passive health: set when a request failed
    static: bool = True
    version: str = ""
    generate_url: str = field(init=False)
    abort_url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.generate_url = self.url + "/internal/generate"
        self.abort_url = self.url + "/internal/abort"

    @property
    def routable(self) -> bool:
        return (self.ready and self.info is not None and self.state == "active"
                and self.down_until <= time.monotonic())

    @property
    def load(self) -> int:
        return self.inflight + self.reported_load

    def mark_failed(self, cooldown_s: float = 2.0) -> None:
        self.down_until = time.monotonic() + cooldown_s
        self.ready = False


class NodePool:
    def __init__(self, session_getter, static: list[Node], registry=None, interval_s: float = 1.0) -> None:
        self._session = session_getter
        self.nodes: dict[str, Node] = {n.node_id: n for n in static}
        self.registry = registry
        self.interval_s = interval_s
        self._ready = asyncio.Event()

    def for_model(self, model: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.model == model and n.routable]

    def models(self) -> set[str]:
        return {n.model for n in self.nodes.values()}

    async def _sync_registry(self) -> None:
        records = await self.registry.list_nodes()
        seen = set()
        for r in records:
            seen.add(r.node_id)
            node = self.nodes.get(r.node_id)
            if node is None or node.url != r.url.rstrip("/") or node.version != r.version:
                node = self.nodes[r.node_id] = Node(r.node_id, r.url, r.model, static=False, version=r.version)
            node.state = r.state
            node.reported_load = r.running + r.waiting
        for node_id in [i for i, n in self.nodes.items() if not n.static and i not in seen]:
            del self.nodes[node_id]

    async def probe(self, node: Node) -> None:
        session: aiohttp.ClientSession = self._session()
        timeout = aiohttp.ClientTimeout(total=max(0.5, self.interval_s * 2))
        try:
            async with session.get(node.url + "/ready", timeout=timeout) as r:
                ready = r.status == 200
            if ready and node.info is None:  # /ready answers 503 while draining; info is fixed per version
                async with session.get(node.url + "/internal/info", timeout=timeout) as r:
                    r.raise_for_status()
                    node.info = info_decoder.decode(await r.read())
            was = node.ready
            node.ready = ready
            if ready:
                node.down_until = 0.0
            if was != ready:
                log.info("node %s (%s) is %s", node.node_id, node.url, "ready" if ready else "not ready")
        except (TimeoutError, aiohttp.ClientError, OSError, msgspec.MsgspecError) as e:
            if node.ready:
                log.warning("node %s (%s) probe failed: %s: %s", node.node_id, node.url, type(e).__name__, e)
            node.ready = False

    async def refresh(self) -> None:
        if self.registry is not None:
            try:
                await self._sync_registry()
            except Exception as e:
                log.warning("registry listing failed: %s: %s", type(e).__name__, e)
        await asyncio.gather(*(self.probe(n) for n in list(self.nodes.values())))
        self._ready.set()

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def wait_first_probe(self) -> None:
        await self._ready.wait()
