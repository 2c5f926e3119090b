"""Which secrets a node refuses to start with: a known placeholder, a documented default, or too weak.

A deployment that starts on a value printed in this repository (deploy/k8s's `REPLACE-with-64-hex-chars`,
compose's old `compose-*-change-me` fallbacks, the README's `sk-change-me`, the built-in cache seed) runs on a
secret anyone can read. Each check returns why a value is refused, or None; callers name the setting in one line.
`edgeinfer ops gen-secrets` writes fresh ones (`secrets.token_hex`).
"""

from __future__ import annotations

import ipaddress

from edgeinfer.protocol.defaults import CACHE_SEED

MIN_SECRET_CHARS = 16
MIN_DISTINCT_CHARS = 8
# words that mark a value as a stand-in for a real one (lower case, compared without dashes and underscores)
PLACEHOLDER_WORDS = ("replace", "changeme", "placeholder", "example", "yoursecret", "yourkey", "secrethere",
                     "notasecret", "insecure", "dummy", "xxxxxx", "todo", "fixme")
# tenant keys documentation uses as stand-ins (the gateway refuses a tenant whose key hash is one of these)
PLACEHOLDER_KEYS = ("sk-change-me", "sk-replace-me", "sk-your-key", "sk-xxx")
# values this repository documents or ships
DOCUMENTED = frozenset({CACHE_SEED, "sk-edgeinfer-demo", "secret", "password", *PLACEHOLDER_KEYS})


def placeholder(value: str) -> str | None:
    """Why `value` is public rather than secret (a value documented here, or a placeholder's wording), or None.
    What a seed is checked for: its length is the operator's choice."""
    v = value.strip()
    if v in DOCUMENTED:
        return "a value documented in edgeinfer's repository (public)"
    squashed = v.lower().replace("-", "").replace("_", "").replace(" ", "")
    hit = next((w for w in PLACEHOLDER_WORDS if w in squashed), None)
    if hit is not None:
        return f"a placeholder (it contains {hit!r}); generate one: edgeinfer ops gen-secrets"
    return None


def weak_secret(value: str, min_chars: int = MIN_SECRET_CHARS) -> str | None:
    """Why `value` must not be used as a secret (a placeholder, a documented default, too short or too plain), or
    None."""
    if (why := placeholder(value)) is not None:
        return why
    v = value.strip()
    if len(v) < min_chars:
        return f"{len(v)} characters; at least {min_chars} needed"
    if len(set(v)) < MIN_DISTINCT_CHARS:
        return f"only {len(set(v))} distinct characters; at least {MIN_DISTINCT_CHARS} needed"
    return None


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
