"""This node's record in the node registry: registered at start, heartbeated, deregistered at stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edgeinfer.backend.engine.kv_port import KVPort
from edgeinfer.cache_store.registry import NodeRecord, NodeRegistry, NodeState, keep_registered


@dataclass
class NodeRegistration:
    port: KVPort
    registry: NodeRegistry
    node_id: str
    url: str
    version: str
    state_fn: Callable[[], NodeState]
    role: str = "both"
    started_at: float = field(default_factory=time.time)

    def record(self) -> NodeRecord:
        load = self.port.load()
        return NodeRecord(node_id=self.node_id, url=self.url, model=self.port.model_name, version=self.version,
                          state=self.state_fn(), running=load.running, waiting=load.waiting,
                          kv_usage=load.kv_usage, cache_hit_rate=load.cache_hit_rate, started_at=self.started_at,
                          role=self.role)

    async def start(self) -> asyncio.Task:
        """Register now; returns the heartbeat task."""
        landed = await self.registry.register(self.record())
        return asyncio.create_task(keep_registered(self.registry, self.record, landed=landed),
                                   name="page-store-heartbeat")

    async def heartbeat(self) -> None:
        await self.registry.heartbeat(self.record())

    async def stop(self) -> None:
        await self.registry.deregister(self.node_id)
