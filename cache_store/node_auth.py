"""Signed node records: Redis is untrusted, so the gateway believes a registry record only when it is
signed by a holder of the internal secret (a backend of this deployment).

signing key = HMAC-SHA256(internal secret, "edgeinfer node record v1"); signature = hex HMAC-SHA256(key,
canonical record) where the canonical record is the JSON array of every field but `sig`, in a fixed order,
tagged with the format. `expires_at` (set by the signer: heartbeat time + registry TTL) bounds replay: a
copied record is refused once it is older than its TTL (plus `clock_skew_s` between the two machines).
Without a secret (backend --insecure-no-internal-auth, gateway with no secret) nothing is signed or checked.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Literal

import msgspec

from edgeinfer.cache_store.node_record import NodeRecord

Refusal = Literal["unsigned", "bad_signature", "expired"]
_CONTEXT = b"edgeinfer node record v1"
_FORMAT = "ei-node-v1"
_encoder = msgspec.json.Encoder()


def _canonical(r: NodeRecord) -> bytes:
    fields = [_FORMAT, r.node_id, r.url, r.model, r.version, r.state, r.running, r.waiting,
              r.kv_usage, r.cache_hit_rate, r.started_at, r.updated_at, r.expires_at]
    if r.role != "both":    # appended only when set, so a record of a node without --role signs as before
        fields.append(r.role)
    return _encoder.encode(fields)


class NodeRecordKey:
    """Signs (backend) and verifies (gateway) node records with a key derived from the internal secret."""

    def __init__(self, internal_secret: str, *, clock_skew_s: float = 5.0) -> None:
        if not internal_secret:
            raise ValueError("a node record key needs a non-empty internal secret")
        self._key = hmac.new(internal_secret.encode(), _CONTEXT, hashlib.sha256).digest()
        self.clock_skew_s = clock_skew_s

    def _mac(self, record: NodeRecord) -> str:
        return hmac.new(self._key, _canonical(record), hashlib.sha256).hexdigest()

    def sign(self, record: NodeRecord, ttl_s: float) -> NodeRecord:
        """`record` with expires_at = updated_at + ttl_s and its signature."""
        unsigned = msgspec.structs.replace(record, expires_at=record.updated_at + ttl_s, sig="")
        return msgspec.structs.replace(unsigned, sig=self._mac(unsigned))

    def refusal(self, record: NodeRecord, now: float | None = None) -> Refusal | None:
        """Why `record` must not be believed, or None when it is genuine and current."""
        if not record.sig:
            return "unsigned"
        if not hmac.compare_digest(record.sig.encode(), self._mac(record).encode()):
            return "bad_signature"
        if (time.time() if now is None else now) > record.expires_at + self.clock_skew_s:
            return "expired"
        return None
