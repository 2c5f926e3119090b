"""Page identity: chained, seeded, namespace-salted xxh3-128 hashes of full pages.

h_0 = H(root, tokens[0:P]); h_i = H(h_{i-1}, tokens[i*P:(i+1)*P]).
root mixes a per-deployment secret seed, the cache namespace (tenant or sharing
group), the model fingerprint, the kv format and the page size, so two
namespaces never share a key and keys cannot be predicted from outside.
Only full pages are hashed.  Torch-free: the gateway imports this.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from edgeinfer.protocol.defaults import PAGE_SIZE

HASH_BYTES = 16


@dataclass(frozen=True)
class PageKeyContext:
    """Everything besides the tokens that goes into a page's identity."""

    seed: bytes
    namespace: str
    model_fingerprint: str
    kv_format: str
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}")
        if not self.namespace:
            raise ValueError("namespace must be a non-empty string (tenant id or sharing group)")

    @property
    def root(self) -> bytes:
        h = xxhash.xxh3_128()
        for part in (self.seed, self.namespace.encode(), self.model_fingerprint.encode(), self.kv_format.encode()):
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        h.update(struct.pack("<I", self.page_size))
        return h.digest()


def hash_page(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """xxh3-128 of parent hash + int32 little-endian tokens."""
    arr = np.asarray(tokens, dtype="<i4")
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(arr.tobytes())
    return h.digest()


def page_hashes(ctx: PageKeyContext, tokens: Sequence[int] | np.ndarray, start_parent: bytes | None = None,
                start_page: int = 0) -> list[bytes]:
    """Hashes of every full page of `tokens` (trailing partial page is not hashed).

    `start_parent`/`start_page` continue an existing chain (hashes already
    computed for pages [0, start_page)).
    """
    arr = np.asarray(tokens, dtype="<i4")
    p = ctx.page_size
    parent = ctx.root if start_parent is None else start_parent
    out: list[bytes] = []
    for i in range(start_page, len(arr) // p):
        parent = hash_page(parent, arr[i * p:(i + 1) * p])
        out.append(parent)
    return out
