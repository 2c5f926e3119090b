"""Redis key layout. One place, so every tier agrees on names and hash tags.

    <p>:page:{<page_hash hex>}          page bytes (one slot per page)
    <p>:idx:{<model>}:<page_hash hex>   set of node ids holding the page
                                        (all of one model's keys share a slot,
                                        so a prefix lookup is one pipeline even
                                        on a Redis Cluster)
    <p>:node:<node_id>                  node record (msgspec JSON)
    <p>:nodes                           set of registered node ids
    <p>:rl:{<tenant>}:<limit>           a tenant's GCRA arrival time per rate limit
                                        (requests | tokens; gateway/admission/)
    <p>:cc:{<tenant>}                   a tenant's stream leases (sorted set; all of
                                        one tenant's keys share a slot)

Page hashes are namespace-salted (see protocol/page_id.py), so the tenant namespace is
already inside every page and index key; no key omits it.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeinfer.protocol.defaults import KEY_PREFIX

_FORBIDDEN = set("{}")


def _check_name(kind: str, value: str) -> str:
    if not value or _FORBIDDEN & set(value) or any(c.isspace() for c in value):
        raise ValueError(f"{kind} {value!r} must be non-empty without braces or whitespace")
    return value


@dataclass(frozen=True)
class KeySpace:
    prefix: str = KEY_PREFIX

    def __post_init__(self) -> None:
        _check_name("key prefix", self.prefix)

    def page(self, page_hash: bytes) -> str:
        return f"{self.prefix}:page:{{{page_hash.hex()}}}"

    def idx_prefix(self, model: str) -> str:
        return f"{self.prefix}:idx:{{{_check_name('model', model)}}}:"

    def idx(self, model: str, page_hash: bytes) -> str:
        return self.idx_prefix(model) + page_hash.hex()

    def node(self, node_id: str) -> str:
        return f"{self.prefix}:node:{_check_name('node id', node_id)}"

    @property
    def nodes(self) -> str:
        return f"{self.prefix}:nodes"

    def rate(self, tenant: str, limit: str) -> str:
        return f"{self.prefix}:rl:{{{tenant}}}:{limit}"

    def leases(self, tenant: str) -> str:
        return f"{self.prefix}:cc:{{{tenant}}}"
