import dataclasses
import random
import struct

import msgspec
import numpy as np
import pytest
import xxhash

from edgeinfer.cache_store import codec
from edgeinfer.cache_store.codec import DecodedPage, Miss, MissReason, PageFormat, PageKey
from edgeinfer.protocol.page_id import PageKeyContext, page_hashes

KEY = PageKey.from_secret(b"codec-test-page-key")


def encode(header, body, salt=None, key=KEY):
    return codec.encode(header, body, key, salt)


def decode(blob, expect, key=KEY):
    return codec.decode(blob, expect, key)

FMT = PageFormat(model_fingerprint="smollm2-135m@abc123", kv_dtype="bfloat16", num_layers=2,
                 kv_heads=3, head_dim=8, page_size=16)
BODY_BYTES = 2 * 2 * 3 * 8 * 16 * 2  # layers * (k, v) * heads * head_dim * page_size * bf16
CTX = PageKeyContext(seed=b"test-seed", namespace="tenant-a", model_fingerprint=FMT.model_fingerprint,
                     kv_format="bfloat16")


def make_page(rng: random.Random, fmt: PageFormat = FMT, body_bytes: int = BODY_BYTES):
    tokens = [rng.randrange(0, 50000) for _ in range(fmt.page_size)]
    parent = rng.randbytes(16)
    page_hash = rng.randbytes(16)
    header = fmt.header(page_hash, parent, tokens)
    body = rng.randbytes(body_bytes)
    return encode(header, body), fmt.expect(page_hash, parent, tokens), body


def frame(version: int, header_bytes: bytes, body: bytes, reserved: int = 0, key: PageKey = KEY) -> bytes:
    """A frame of any version, correctly sealed with `key` (the writer holds the key)."""
    env = struct.pack("<4sHHIQ", b"EIKV", version, reserved, len(header_bytes), len(body))
    sealed = env + header_bytes + body + b"s" * codec.SALT_BYTES
    return sealed + key.mac(b"s" * codec.SALT_BYTES, sealed)


def v1_frame(header_bytes: bytes, body: bytes) -> bytes:
    """The old unkeyed format: envelope v1 | header | body | xxh3-64 of all of it (anyone can compute it)."""
    env = struct.pack("<4sHHIQ", b"EIKV", 1, 0, len(header_bytes), len(body))
    return env + header_bytes + body + struct.pack("<Q", xxhash.xxh3_64_intdigest(env + header_bytes + body))


def test_round_trip_body_is_a_view_into_the_blob():
    blob, expect, body = make_page(random.Random(1))
    page = decode(blob, expect)
    assert isinstance(page, DecodedPage)
    assert page.body.tobytes() == body
    assert page.body.obj is blob
    assert page.header.tokens == expect.tokens
    assert (page.header.kv_heads, page.header.head_dim, page.header.page_size) == (3, 8, 16)


@pytest.mark.parametrize("as_buffer", [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.uint16)])
def test_encode_accepts_any_contiguous_buffer(as_buffer):
    rng = random.Random(2)
    blob, expect, body = make_page(rng)
    again = encode(decode(blob, expect).header, as_buffer(body), salt=blob[-32:-16])
    assert again == blob
    assert isinstance(decode(memoryview(again), expect), DecodedPage)


def test_tokens_accepted_as_list_array_or_bytes():
    rng = random.Random(3)
    tokens = [rng.randrange(50000) for _ in range(16)]
    h = FMT.header(b"h" * 16, b"p" * 16, tokens)
    assert h == FMT.header(b"h" * 16, b"p" * 16, np.array(tokens, dtype=np.int64))
    assert h == FMT.header(b"h" * 16, b"p" * 16, np.array(tokens, dtype="<i4").tobytes())
    with pytest.raises(ValueError, match="a page holds 16 tokens, got 15"):
        FMT.header(b"h" * 16, b"p" * 16, tokens[:15])


def assert_miss(result, reason: MissReason):
    assert isinstance(result, Miss), result
    assert result.reason is reason, result
    assert result.integrity_failure is reason.integrity


@pytest.mark.parametrize("keep", [0, 1, 19, 27, 28, 40, "all-but-one"])
def test_truncated(keep):
    blob, expect, _ = make_page(random.Random(4))
    n = len(blob) - 1 if keep == "all-but-one" else keep
    assert_miss(decode(blob[:n], expect), MissReason.TRUNCATED)


def test_trailing_bytes():
    blob, expect, _ = make_page(random.Random(5))
    assert_miss(decode(blob + b"\0", expect), MissReason.BAD_LENGTH)


def test_bad_magic():
    blob, expect, _ = make_page(random.Random(6))
    assert_miss(decode(b"NOPE" + blob[4:], expect), MissReason.BAD_MAGIC)
    assert_miss(decode(b"\0" * 200, expect), MissReason.BAD_MAGIC)


def test_tag_mismatch():
    blob, expect, _ = make_page(random.Random(7))
    bad = bytearray(blob)
    bad[-1] ^= 0x80  # the tag itself
    assert_miss(decode(bytes(bad), expect), MissReason.TAG_MISMATCH)


def test_unknown_version_is_incompatible_not_corrupt():
    rng = random.Random(8)
    _, expect, body = make_page(rng)
    header = codec.PageHeader(3, expect.page_hash, expect.parent_hash, expect.tokens, *[
        getattr(FMT, f) for f in ("model_fingerprint", "kv_dtype", "num_layers", "kv_heads", "head_dim",
                                  "page_size", "scale_layout")])
    assert_miss(decode(frame(3, codec._header_encoder.encode(header), body), expect), MissReason.UNKNOWN_VERSION)
    with pytest.raises(ValueError, match="cannot write format version 3"):
        encode(header, body)


@pytest.mark.parametrize("header_bytes", [b"", b"\xc1", b"\x93\x01\x02\x03", b"\x91\xa3abc"])
def test_bad_header_with_valid_tag(header_bytes):
    _, expect, body = make_page(random.Random(9))
    assert_miss(decode(frame(2, header_bytes, body), expect), MissReason.BAD_HEADER)


def test_header_version_disagrees_with_frame():
    blob, expect, body = make_page(random.Random(10))
    page = decode(blob, expect)
    header_bytes = codec._header_encoder.encode(
        codec.PageHeader(7, *[getattr(page.header, f) for f in codec.PageHeader.__struct_fields__[1:]]))
    assert_miss(decode(frame(2, header_bytes, body), expect), MissReason.BAD_HEADER)


@pytest.mark.parametrize("field,reason", [("page_hash", MissReason.HASH_MISMATCH),
                                          ("parent_hash", MissReason.PARENT_MISMATCH),
                                          ("tokens", MissReason.TOKENS_MISMATCH)])
def test_collision_guard(field, reason):
    blob, expect, _ = make_page(random.Random(11))
    wrong = bytearray(getattr(expect, field))
    wrong[0] ^= 1
    assert_miss(decode(blob, expect._replace(**{field: bytes(wrong)})), reason)


@pytest.mark.parametrize("change", [dict(kv_dtype="float8_e4m3fn"), dict(kv_heads=4), dict(head_dim=16),
                                    dict(page_size=32), dict(num_layers=3), dict(scale_layout="per_head_f32"),
                                    dict(model_fingerprint="other-model")])
def test_header_disagrees_with_engine(change):
    blob, expect, _ = make_page(random.Random(12))
    other = dataclasses.replace(FMT, **change)
    miss = decode(blob, expect._replace(format=other))
    assert_miss(miss, MissReason.FORMAT_MISMATCH)
    assert next(iter(change)) in miss.detail


def test_body_size_checked_when_engine_knows_it():
    blob, expect, _ = make_page(random.Random(13))
    ok = dataclasses.replace(FMT, body_nbytes=BODY_BYTES)
    assert isinstance(decode(blob, expect._replace(format=ok)), DecodedPage)
    short = dataclasses.replace(FMT, body_nbytes=BODY_BYTES + 2)
    assert_miss(decode(blob, expect._replace(format=short)), MissReason.BODY_SIZE)


def flip_bit(blob: bytes, bit: int) -> bytes:
    out = bytearray(blob)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_every_single_bit_flip_of_a_page_is_an_integrity_failure():
    blob, expect, _ = make_page(random.Random(14), body_bytes=64)
    for bit in range(len(blob) * 8):
        result = decode(flip_bit(blob, bit), expect)
        assert isinstance(result, Miss) and result.integrity_failure, (bit, result)


def test_random_bit_flips_in_header_and_body_over_400_pages():
    rng = random.Random(15)
    seen: dict[MissReason, int] = {}
    for i in range(400):
        blob, expect, _ = make_page(rng, body_bytes=rng.choice([BODY_BYTES, 4096, 1 << 16]))
        header_len = struct.unpack_from("<I", blob, 8)[0]
        header_end = codec.ENVELOPE_BYTES + header_len
        if i % 2:
            region = (0, header_end)  # envelope + header
        else:
            region = (header_end, len(blob) - codec.TAG_BYTES)  # body
        for _ in range(rng.choice([1, 1, 2, 7])):
            blob = flip_bit(blob, rng.randrange(region[0] * 8, region[1] * 8))
        result = decode(blob, expect)
        assert isinstance(result, Miss) and result.integrity_failure, (i, result)
        seen[result.reason] = seen.get(result.reason, 0) + 1
    assert seen.get(MissReason.TAG_MISMATCH, 0) >= 200


def test_decode_never_raises_on_garbage():
    rng = random.Random(16)
    _, expect, _ = make_page(rng)
    for n in list(range(0, 64)) + [rng.randrange(64, 5000) for _ in range(200)]:
        garbage = b"EIKV" + rng.randbytes(n) if n % 2 else rng.randbytes(n)
        assert isinstance(decode(garbage, expect), Miss)


def test_namespace_isolation_same_tokens_different_hashes():
    tokens = list(range(64))
    a = page_hashes(CTX, tokens)
    b = page_hashes(PageKeyContext(seed=b"test-seed", namespace="tenant-b",
                                   model_fingerprint=FMT.model_fingerprint, kv_format="bfloat16"), tokens)
    assert len(a) == len(b) == 4 and not set(a) & set(b)
    blob = encode(FMT.header(a[0], CTX.root, tokens[:16]), b"\0" * BODY_BYTES)
    assert_miss(decode(blob, FMT.expect(b[0], CTX.root, tokens[:16])), MissReason.HASH_MISMATCH)


# ---------------------------------------------------------------------------------------------------- the key

def test_a_page_sealed_with_another_key_is_an_integrity_failure():
    blob, expect, body = make_page(random.Random(20))
    other = PageKey.from_secret(b"some-other-deployment")
    assert_miss(decode(blob, expect, key=other), MissReason.TAG_MISMATCH)
    assert isinstance(decode(encode(decode(blob, expect).header, body, key=other), expect, key=other), DecodedPage)


def test_an_old_unkeyed_page_with_a_valid_xxh3_tag_is_a_miss_not_an_error():
    """The forgery of issue 14: the v1 format with a recomputed xxh3 tag; anyone could write it."""
    blob, expect, body = make_page(random.Random(21))
    header = decode(blob, expect).header
    old = v1_frame(codec._header_encoder.encode(msgspec.structs.replace(header, format_version=1)), body)
    assert_miss(decode(old, expect), MissReason.UNKNOWN_VERSION)
    assert "no MAC" in decode(old, expect).detail


def test_body_swapped_under_a_kept_salt_and_mac_is_an_integrity_failure():
    rng = random.Random(22)
    blob, expect, body = make_page(rng)
    swapped = blob[:-codec.TAG_BYTES - len(body)] + rng.randbytes(len(body)) + blob[-codec.TAG_BYTES:]
    assert len(swapped) == len(blob)
    assert_miss(decode(swapped, expect), MissReason.TAG_MISMATCH)


def test_every_page_gets_a_fresh_salt():
    rng = random.Random(23)
    blob, expect, body = make_page(rng)
    again = encode(decode(blob, expect).header, body)
    assert again[-32:-16] != blob[-32:-16] and again[-16:] != blob[-16:]
    assert isinstance(decode(again, expect), DecodedPage)


def test_page_key_secrets_are_long_enough_and_never_printed():
    with pytest.raises(ValueError, match="at least 16 bytes, got 5"):
        PageKey.from_secret(b"short")
    k = PageKey.from_secret(b"0123456789abcdef", origin="page key from $EDGEINFER_PAGE_KEY")
    assert k.key.hex() not in repr(k) and "EDGEINFER_PAGE_KEY" in repr(k)
    assert k != PageKey.from_seed(b"0123456789abcdef")     # a seed-derived key is another key
