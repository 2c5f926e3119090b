"""Page codec: msgspec header + contiguous KV body + xxh3-64 integrity tag.

Frame (little-endian), identical for every format version so that the tag can
be checked before the header schema is interpreted:

    magic "EIKV" | version u16 | reserved u16 | header_len u32 | body_len u64
    | header (msgpack PageHeader, array-like) | body | tag u64

tag = xxh3-64 over every byte before it (envelope + header + body), so a flip
of any bit, including the lengths and the reserved field, is detected.
`decode` never raises on bad bytes: it returns a `Miss` whose reason says
whether the bytes are damaged (an integrity failure: count it, delete the
page) or merely unusable by this engine (an incompatibility: leave it).
Torch-free: the gateway imports cache_store.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import numpy as np
import xxhash

from cache_store.page_id import HASH_BYTES

MAGIC = b"EIKV"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = frozenset({FORMAT_VERSION})

_ENVELOPE = struct.Struct("<4sHHIQ")
_TAG = struct.Struct("<Q")
ENVELOPE_BYTES = _ENVELOPE.size
TAG_BYTES = _TAG.size
MAX_HEADER_BYTES = 1 << 20

Buffer = bytes | bytearray | memoryview


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
    TAG_MISMATCH = ("tag_mismatch", True)
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
    page_size: int = 16
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


def encode(header: PageHeader, body: Buffer) -> bytes:
    """Frame `header` and `body` into one blob; the body is copied exactly once (into the result)."""
    hdr = _header_encoder.encode(header)
    body_view = memoryview(body).cast("B")
    env = _ENVELOPE.pack(MAGIC, header.format_version, 0, len(hdr), body_view.nbytes)
    h = xxhash.xxh3_64()
    h.update(env)
    h.update(hdr)
    h.update(body_view)
    return b"".join((env, hdr, body_view, _TAG.pack(h.intdigest())))


def decode(blob: Buffer, expect: PageExpectation) -> DecodedPage | Miss:
    """Verify and parse one page. Never raises on bad bytes; returns a Miss instead."""
    view = memoryview(blob).cast("B")
    n = view.nbytes
    if n < ENVELOPE_BYTES + TAG_BYTES:
        return Miss(MissReason.TRUNCATED, f"{n} bytes, a frame needs at least {ENVELOPE_BYTES + TAG_BYTES}")
    magic, version, _reserved, header_len, body_len = _ENVELOPE.unpack_from(view)
    if magic != MAGIC:
        return Miss(MissReason.BAD_MAGIC, f"magic {bytes(magic)!r}")
    want = ENVELOPE_BYTES + header_len + body_len + TAG_BYTES
    if n < want:
        return Miss(MissReason.TRUNCATED, f"{n} bytes, frame declares {want}")
    if n > want:
        return Miss(MissReason.BAD_LENGTH, f"{n} bytes, frame declares {want}")
    tagged = n - TAG_BYTES
    (tag,) = _TAG.unpack_from(view, tagged)
    actual = xxhash.xxh3_64_intdigest(view[:tagged])
    if actual != tag:
        return Miss(MissReason.TAG_MISMATCH, f"stored tag {tag:016x}, computed {actual:016x}")
    if version not in SUPPORTED_VERSIONS:
        return Miss(MissReason.UNKNOWN_VERSION, f"format version {version}; supported {sorted(SUPPORTED_VERSIONS)}")
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
