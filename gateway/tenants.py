"""API key -> tenant. Keys are stored only as sha256 digests; the table is swapped atomically on reload."""

from __future__ import annotations

import hashlib
import hmac

from edgeinfer.gateway.config import TenantConfig
from edgeinfer.gateway.errors import APIError


class TenantTable:
    """Lookup is by sha256(key): the dict probe can only leak timing about a digest (preimage-resistant),
    and the final equality check is hmac.compare_digest. Several keys per tenant allow rotation:
    add the new key, reload, move clients, drop the old key, reload."""

    def __init__(self, tenants: list[TenantConfig]) -> None:
        self.tenants = {t.id: t for t in tenants}
        self._by_digest: dict[bytes, TenantConfig] = {}
        for t in tenants:
            for h in t.api_key_sha256:
                self._by_digest[bytes.fromhex(h)] = t

    def __len__(self) -> int:
        return len(self.tenants)

    def authenticate(self, authorization: str | None) -> TenantConfig:
        if not authorization:
            raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", code="missing_api_key")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "malformed Authorization header: expected `Bearer <key>`",
                           code="invalid_api_key")
        digest = hashlib.sha256(key.encode()).digest()
        tenant = self._by_digest.get(digest)
        for h in (tenant.api_key_sha256 if tenant else ()):
            if hmac.compare_digest(bytes.fromhex(h), digest):
                return tenant  # type: ignore[return-value]
        raise APIError(401, "invalid API key", code="invalid_api_key")
