"""`edgeinfer ops gen-secrets`: fresh secrets for a deployment, in the files its manifests read.

  edgeinfer ops gen-secrets --compose [DIR]   DIR/.env (compose's variables) + DIR/deploy/compose/tenants.toml
  edgeinfer ops gen-secrets --k8s [DIR]       DIR/secrets.env + DIR/tenants.toml (deploy/k8s's secretGenerator)

Each run draws the internal secret, the page key, the cache seed and the operator key from `secrets.token_hex`,
and one tenant API key, whose sha256 goes into tenants.toml and whose value is printed once (it is stored nowhere
else). Existing files are never overwritten (exit 2). The secrets file is written 0600; tenants.toml, which holds only
key hashes, 0644 (a container's own user, uid 10001, reads it through compose's bind mount).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

SECRET_VARS = (("EDGEINFER_INTERNAL_SECRET", 32), ("EDGEINFER_PAGE_KEY", 32), ("EDGEINFER_CACHE_SEED", 16),
               ("EDGEINFER_OPERATOR_KEY", 24))


class GenSecretsError(Exception):
    pass


def fresh() -> tuple[dict[str, str], str]:
    """({variable: value}, tenant API key)."""
    return {name: secrets.token_hex(n) for name, n in SECRET_VARS}, "sk-" + secrets.token_urlsafe(32)


def tenants_toml(api_key: str, tenant_id: str = "default") -> str:
    digest = hashlib.sha256(api_key.encode()).hexdigest()
    return (f"# written by `edgeinfer ops gen-secrets`: the sha256 of the key it printed once (not the key)\n"
            f"[[tenants]]\nid = \"{tenant_id}\"\napi_key_sha256 = [\"{digest}\"]\nrequests_per_min = 600\n"
            f"tokens_per_min = 200000\nmax_concurrent_streams = 16\n")


def _write_new(path: Path, text: str) -> None:
    """A new file (never over one) with the mode its contents need, whatever the umask: tenants.toml holds only key
    hashes (0644: a container's own user reads it), the rest secrets (0600)."""
    mode = 0o644 if path.name == "tenants.toml" else 0o600
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as e:
        raise GenSecretsError(f"{path} exists; not overwritten (remove it first to rotate every secret)") from e
    os.fchmod(fd, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def generate(kind: str, root: Path) -> tuple[list[Path], str]:
    """Write the files for `kind` ("compose" | "k8s") under `root`; returns (paths written, the tenant key)."""
    values, api_key = fresh()
    env = "".join(f"{k}={v}\n" for k, v in values.items())
    if kind == "compose":
        files = [(root / ".env", env), (root / "deploy" / "compose" / "tenants.toml", tenants_toml(api_key))]
    elif kind == "k8s":
        files = [(root / "secrets.env", env), (root / "tenants.toml", tenants_toml(api_key))]
    else:
        raise GenSecretsError(f"unknown target {kind!r}: expected compose or k8s")
    for path, _ in files:
        if path.exists():
            raise GenSecretsError(f"{path} exists; not overwritten (remove it first to rotate every secret)")
    for path, text in files:
        _write_new(path, text)
    return [p for p, _ in files], api_key
