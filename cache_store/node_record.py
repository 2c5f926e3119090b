"""What a backend node publishes about itself in the registry (cache_store/registry.py), signed by
cache_store/node_auth.py: the record both of them read, below both."""

from __future__ import annotations

from typing import Literal

import msgspec

NodeState = Literal["active", "draining"]


class NodeRecord(msgspec.Struct, frozen=True):
    node_id: str
    url: str
    model: str
    version: str
    state: NodeState = "active"
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of the KV pool in use, 0..1
    cache_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens, recent window
    started_at: float = 0.0  # unix seconds
    updated_at: float = 0.0  # unix seconds of the heartbeat that wrote this record
    expires_at: float = 0.0  # unix seconds after which a signed record is refused (cache_store.node_auth)
    sig: str = ""  # hex HMAC over the other fields (cache_store.node_auth); empty without an internal secret
    role: str = "both"  # prefill | decode | both (backend --role); signed when not "both"
