"""Page codec: msgspec header + contiguous KV body + a keyed MAC.

Frame (little-endian). The envelope is identical for every format version, so the
version is known before anything else is interpreted:

    magic "EIKV" | version u16 | reserved u16 | header_len u32 | body_len u64
    | header (msgpack PageHeader, array-like) | body | salt 16B | mac 16B

(every version from 2 on ends in salt | mac, so the MAC is checked before the
version: a flipped bit anywhere, the version included, is an integrity failure)

mac = AES-256-GMAC (AES-GCM with an empty plaintext) over every byte before it
(envelope + header + body + salt), under a one-page key BLAKE2b(key=page key,
salt) with a fresh random salt per page. Only a holder of the deployment's page
key (PageKey) can write a page another node accepts: Redis is untrusted storage,
a writer without the key cannot inject KV (it can only delete or damage pages,
which are then recomputed). GMAC rather than HMAC/keyed BLAKE2b: it is the only
keyed MAC here fast enough to stay a small share of a page transfer
(benchmarks/cache.py). Version 1 (an unkeyed xxh3-64 tag) is no longer
accepted: such a page is an incompatibility (a miss), never served.
`decode` never raises on bad bytes: it returns a `Miss` whose reason says
whether the bytes are damaged or forged (an integrity failure: count it, delete
the page) or merely unusable by this engine (an incompatibility: leave it).
Torch-free: the gateway imports cache_store.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from edgeinfer.protocol.defaults import PAGE_SIZE
from edgeinfer.protocol.page_id import HASH_BYTES

MAGIC = b"EIKV"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = frozenset({FORMAT_VERSION})
LEGACY_VERSION = 1   # unkeyed xxh3-64 tag: never trusted

_ENVELOPE = struct.Struct("<4sHHIQ")
ENVELOPE_BYTES = _ENVELOPE.size
SALT_BYTES = 16
MAC_BYTES = 16
TAG_BYTES = SALT_BYTES + MAC_BYTES   # everything after the body
MIN_SECRET_BYTES = 16
_NONCE = bytes(12)   # every one-page key is used for exactly one MAC, so a fixed nonce is safe
MAX_HEADER_BYTES = 1 << 20

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class PageKey:
    """The deployment's page MAC key; every node that shares pages must hold the same one."""

    key: bytes = field(repr=False)
    origin: str = "page key"   # where it came from, for logs and misses (never the key itself)

    def __post_init__(self) -> None:
        if len(self.key) != 32:
            raise ValueError(f"a page key is 32 bytes, got {len(self.key)}")

    @classmethod
    def from_secret(cls, secret: bytes, origin: str = "page key") -> PageKey:
        """A key from an operator's secret (EDGEINFER_PAGE_KEY / --page-key-file): any bytes, >= 16 of them."""
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"{origin}: a page key needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        return cls(hashlib.blake2b(secret, digest_size=32, person=b"ei-page-key").digest(), origin)

    @classmethod
    def from_seed(cls, seed: bytes) -> PageKey:
        """Fallback: a key derived from the deployment's cache seed (exactly as secret as the seed)."""
        return cls(hashlib.blake2b(seed, digest_size=32, person=b"ei-page-key-seed").digest(), "cache seed")

    def mac(self, salt: Buffer, data: Buffer) -> bytes:
        one_page_key = hashlib.blake2b(salt, key=self.key, digest_size=32, person=b"ei-page-gmac").digest()
        return AESGCM(one_page_key).encrypt(_NONCE, b"", data)


class PageHeader(msgspec.Struct, frozen=True, array_like=True):
    """Everything needed to decide whether a page body is usable, before touching it."""

    format_version: int
    page_hash: bytes
    parent_hash: bytes
    tokens: bytes  # int32 little-endian, page_size of them
    model_fingerprint: str
    kv_dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    scale_layout: str  # "none" for bf16/fp16/fp32; e.g. "per_layer_kv_head_f32" for fp8


class MissReason(enum.Enum):
    # integrity: the bytes are damaged or do not belong under the key they were read from
    TRUNCATED = ("truncated", True)
    BAD_LENGTH = ("bad_length", True)
    BAD_MAGIC = ("bad_magic", True)
    TAG_MISMATCH = ("tag_mismatch", True)   # the MAC does not verify: damaged, or written without the key
    BAD_HEADER = ("bad_header", True)
    HASH_MISMATCH = ("hash_mismatch", True)
    PARENT_MISMATCH = ("parent_mismatch", True)
    TOKENS_MISMATCH = ("tokens_mismatch", True)
    # incompatibility: a well-formed page this engine cannot use
    UNKNOWN_VERSION = ("unknown_version", False)
    FORMAT_MISMATCH = ("format_mismatch", False)
    BODY_SIZE = ("body_size", False)

    def __init__(self, label: str, integrity: bool) -> None:
        self.label = label
        self.integrity = integrity


class Miss(NamedTuple):
    reason: MissReason
    detail: str

    @property
    def integrity_failure(self) -> bool:
        """True when the caller must count the failure and delete the page from its source."""
        return self.reason.integrity


class DecodedPage(NamedTuple):
    header: PageHeader
    body: memoryview  # a view into the blob passed to decode(); no copy


def tokens_bytes(tokens: Sequence[int] | np.ndarray | bytes) -> bytes:
    if isinstance(tokens, bytes):
        return tokens
    return np.asarray(tokens, dtype="<i4").tobytes()


@dataclass(frozen=True)
class PageFormat:
    """The engine's KV layout; one per (model, kv format, page size)."""

    model_fingerprint: str
    kv_dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int = PAGE_SIZE
    scale_layout: str = "none"
    body_nbytes: int | None = None  # when set, decode() also checks the body length

    def header(self, page_hash: bytes, parent_hash: bytes,
               tokens: Sequence[int] | np.ndarray | bytes) -> PageHeader:
        tok = tokens_bytes(tokens)
        if len(page_hash) != HASH_BYTES or len(parent_hash) != HASH_BYTES:
            raise ValueError(f"page and parent hashes must be {HASH_BYTES} bytes, "
                             f"got {len(page_hash)} and {len(parent_hash)}")
        if len(tok) != 4 * self.page_size:
            raise ValueError(f"a page holds {self.page_size} tokens, got {len(tok) // 4}")
        return PageHeader(FORMAT_VERSION, page_hash, parent_hash, tok, self.model_fingerprint,
                          self.kv_dtype, self.num_layers, self.kv_heads, self.head_dim,
                          self.page_size, self.scale_layout)

    def expect(self, page_hash: bytes, parent_hash: bytes,
               tokens: Sequence[int] | np.ndarray | bytes) -> PageExpectation:
        return PageExpectation(self, page_hash, parent_hash, tokens_bytes(tokens))


class PageExpectation(NamedTuple):
    """What the requesting engine needs one fetched page to be."""

    format: PageFormat
    page_hash: bytes
    parent_hash: bytes
    tokens: bytes  # int32 little-endian


_FORMAT_FIELDS = ("model_fingerprint", "kv_dtype", "num_layers", "kv_heads", "head_dim",
                  "page_size", "scale_layout")
_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(PageHeader)


def encode(header: PageHeader, body: Buffer, key: PageKey, salt: bytes | None = None) -> bytes:
    """Frame `header` and `body` into one blob sealed with `key` (a fresh random salt unless given)."""
    if header.format_version != FORMAT_VERSION:
        raise ValueError(f"cannot write format version {header.format_version}; this codec writes {FORMAT_VERSION}")
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    if len(salt) != SALT_BYTES:
        raise ValueError(f"salt must be {SALT_BYTES} bytes, got {len(salt)}")
    hdr = _header_encoder.encode(header)
    body_view = memoryview(body).cast("B")
    env = _ENVELOPE.pack(MAGIC, header.format_version, 0, len(hdr), body_view.nbytes)
    sealed = b"".join((env, hdr, body_view, salt))
    return sealed + key.mac(salt, sealed)


def decode(blob: Buffer, expect: PageExpectation, key: PageKey) -> DecodedPage | Miss:
    """Verify (MAC under `key`) and parse one page. Never raises on bad bytes; returns a Miss instead."""
    view = memoryview(blob).cast("B")
    n = view.nbytes
    if n < ENVELOPE_BYTES:
        return Miss(MissReason.TRUNCATED, f"{n} bytes, the envelope alone is {ENVELOPE_BYTES}")
    magic, version, _reserved, header_len, body_len = _ENVELOPE.unpack_from(view)
    if magic != MAGIC:
        return Miss(MissReason.BAD_MAGIC, f"magic {bytes(magic)!r}")
    if version == LEGACY_VERSION:   # an unkeyed page of the old format: never trusted, left for old nodes
        return Miss(MissReason.UNKNOWN_VERSION, f"format version {version} (no MAC); supported "
                                                f"{sorted(SUPPORTED_VERSIONS)}")
    want = ENVELOPE_BYTES + header_len + body_len + TAG_BYTES
    if n < want:
        return Miss(MissReason.TRUNCATED, f"{n} bytes, frame declares {want}")
    if n > want:
        return Miss(MissReason.BAD_LENGTH, f"{n} bytes, frame declares {want}")
    sealed = n - MAC_BYTES
    stored = view[sealed:]
    actual = key.mac(view[sealed - SALT_BYTES:sealed], view[:sealed])
    if not hmac.compare_digest(actual, stored):
        return Miss(MissReason.TAG_MISMATCH, f"MAC {bytes(stored).hex()} does not verify under the {key.origin} "
                                             "(damaged, or written without this deployment's page key)")
    if version not in SUPPORTED_VERSIONS:   # sealed with our key by a node of another version
        return Miss(MissReason.UNKNOWN_VERSION, f"format version {version}; supported {sorted(SUPPORTED_VERSIONS)}")
    tagged = sealed - SALT_BYTES
    if header_len > MAX_HEADER_BYTES:
        return Miss(MissReason.BAD_HEADER, f"header of {header_len} bytes")
    hdr_start = ENVELOPE_BYTES
    body_start = hdr_start + header_len
    try:
        header = _header_decoder.decode(view[hdr_start:body_start])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Miss(MissReason.BAD_HEADER, str(e))
    if header.format_version != version:
        return Miss(MissReason.BAD_HEADER, f"header version {header.format_version} in a v{version} frame")
    miss = _check_expectation(header, body_len, expect)
    if miss is not None:
        return miss
    return DecodedPage(header, view[body_start:tagged])


def _check_expectation(header: PageHeader, body_len: int, expect: PageExpectation) -> Miss | None:
    if header.page_hash != expect.page_hash:
        return Miss(MissReason.HASH_MISMATCH,
                    f"page {header.page_hash.hex()} stored where {expect.page_hash.hex()} was expected")
    if header.parent_hash != expect.parent_hash:
        return Miss(MissReason.PARENT_MISMATCH,
                    f"page {expect.page_hash.hex()}: parent {header.parent_hash.hex()}, "
                    f"expected {expect.parent_hash.hex()}")
    if header.tokens != expect.tokens:
        return Miss(MissReason.TOKENS_MISMATCH, f"page {expect.page_hash.hex()}: token ids differ")
    fmt = expect.format
    for name in _FORMAT_FIELDS:
        got, want = getattr(header, name), getattr(fmt, name)
        if got != want:
            return Miss(MissReason.FORMAT_MISMATCH, f"{name} {got!r}, engine expects {want!r}")
    if fmt.body_nbytes is not None and body_len != fmt.body_nbytes:
        return Miss(MissReason.BODY_SIZE, f"body of {body_len} bytes, engine expects {fmt.body_nbytes}")
    return None
