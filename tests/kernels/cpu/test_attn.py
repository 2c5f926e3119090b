"""edgeinfer.kernels.cpu.attn (C++ AVX2): each op against its pure-torch reference (kernels.cpu.attn_reference, the model's
own torch path) on paged pools of every KV dtype, with tolerances that a plausible bug (a wrong scale, a
skipped fp8 scale, an off-by-one page, the rotation's halves swapped) fails; bad inputs name their numbers."""

from __future__ import annotations

import pytest
import torch

import edgeinfer.kernels.cpu.attn as ka
from edgeinfer.kernels.cpu import attn_reference as ref
from edgeinfer.kernels.kv_store import kv_store_reference

FP8 = torch.float8_e4m3fn
INT8 = torch.int8
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, FP8, INT8]
PAGE = 16


@pytest.fixture(scope="module")
def ext():
    return ka._ext()   # builds (or loads the cached build); a missing compiler fails here, loudly


def pool(num_pages: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int = 0):
    """A paged pool filled through the reference kv_store (fp8/int8: real per-token scales), -> (k, v, ks, vs)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, PAGE, kv_heads, d)
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    ks = vs = None
    if dtype in (FP8, INT8):
        ks, vs = torch.ones(shape[:3], dtype=torch.bfloat16), torch.ones(shape[:3], dtype=torch.bfloat16)
    n = num_pages * PAGE
    src_k = torch.randn(n, kv_heads, d, generator=g) * (1 + torch.rand(n, kv_heads, 1, generator=g) * 3)
    src_v = torch.randn(n, kv_heads, d, generator=g)
    kv_store_reference(src_k, src_v, k, v, torch.arange(n), ks, vs)
    return k, v, ks, vs


def tables(lens: list[int], num_pages: int, width: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    for i in range(len(lens)):
        bt[i] = perm[(i * width) % num_pages:][:width] if num_pages - (i * width) % num_pages >= width else perm[:width]
    return bt, torch.tensor(lens, dtype=torch.int32)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


ATTN_TOL = 2e-5   # fp32 summation order and exp's last bits; every bug below is >= 1e-3


@pytest.mark.parametrize("avx512", ["1", "0"], ids=["avx512-if-present", "avx2"])
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_attention_matches_reference_on_every_kv_dtype(ext, dtype, heads, kv_heads, avx512, monkeypatch):
    """fp8 pages take the 16-lane AVX-512 path where the CPU has it (EDGEINFER_CPU_AVX512=0: the AVX2 one)."""
    monkeypatch.setenv("EDGEINFER_CPU_AVX512", avx512)
    d, num_pages = 64, 40
    k, v, ks, vs = pool(num_pages, kv_heads, d, dtype)
    lens = [1, 17, 160, 0, 300]                               # one token, a partial page, many pages, empty
    bt, cl = tables(lens, num_pages, 20)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(2))
    q = qkv[:, : heads * d].view(len(lens), heads, d)          # strided along the batch, as the model passes it
    got = ext.decode_attention(q, k, v, bt, cl, d ** -0.5, ks, vs)
    want = ref.decode_attention(q.contiguous(), k, v, bt, cl, d ** -0.5, ks, vs)
    assert got.shape == want.shape == (len(lens), heads, d)
    assert rel_err(got, want) < ATTN_TOL
    assert torch.equal(got[3], torch.zeros(heads, d))         # empty context -> zeros, as the reference


@pytest.mark.parametrize("avx512", ["1", "0"], ids=["avx512-if-present", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, FP8, INT8])
def test_a_long_context_split_over_tasks_matches_the_reference_whatever_its_batch(ext, dtype, avx512, monkeypatch):
    """Contexts past 512 keys are attended in 512-key splits merged by their max and sum (flash-decoding): the
    reference's attention, and a sequence's bits are the same alone or beside others (the split depends only on
    its own length). A split dropped or merged without its max would be off by far more than ATTN_TOL."""
    monkeypatch.setenv("EDGEINFER_CPU_AVX512", avx512)
    d, kv_heads, heads, num_pages = 64, 3, 9, 140
    k, v, ks, vs = pool(num_pages, kv_heads, d, dtype, seed=4)
    lens = [1300, 513, 40, 1024]                               # 3 splits (the last partial), 2 (one key), none, 2
    bt, cl = tables(lens, num_pages, 82)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(5))
    got = ext.decode_attention(q, k, v, bt, cl, d ** -0.5, ks, vs)
    want = ref.decode_attention(q, k, v, bt, cl, d ** -0.5, ks, vs)
    assert rel_err(got, want) < ATTN_TOL
    for i in (0, 1, 3):
        alone = ext.decode_attention(q[i:i + 1].contiguous(), k, v, bt[i:i + 1], cl[i:i + 1], d ** -0.5, ks, vs)
        assert torch.equal(alone[0], got[i])
    first_split_only = ext.decode_attention(q[:1].contiguous(), k, v, bt[:1], torch.tensor([512], dtype=torch.int32),
                                            d ** -0.5, ks, vs)
    assert rel_err(first_split_only[0], want[0]) > 50 * ATTN_TOL


def test_decode_attention_of_a_sequence_does_not_depend_on_its_batch(ext):
    k, v, _, _ = pool(40, 3, 64, torch.float32)
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(6))
    bt = torch.arange(32, dtype=torch.int32).view(2, 16)
    alone = ext.decode_attention(q[:1], k, v, bt[:1], torch.tensor([100], dtype=torch.int32), 0.125)
    paired = ext.decode_attention(q, k, v, bt, torch.tensor([100, 201], dtype=torch.int32), 0.125)
    assert torch.equal(alone[0], paired[0])   # the reference pads to the longest context: different bits


def test_decode_attention_tolerance_fails_plausible_bugs(ext):
    d, heads, kv_heads, num_pages = 64, 9, 3, 40
    k, v, ks, vs = pool(num_pages, kv_heads, d, FP8)
    bt, cl = tables([33, 150], num_pages, 20)
    q = torch.randn(2, heads, d, generator=torch.Generator().manual_seed(3)) * 3
    want = ref.decode_attention(q, k, v, bt, cl, d ** -0.5, ks, vs)
    assert rel_err(ext.decode_attention(q, k, v, bt, cl, d ** -0.5, ks, vs), want) < ATTN_TOL
    bugs = {
        "scale off by 2%": ext.decode_attention(q, k, v, bt, cl, 1.02 * d ** -0.5, ks, vs),
        "k scales ignored": ext.decode_attention(q, k, v, bt, cl, d ** -0.5, torch.ones_like(ks), vs),
        "v scales ignored": ext.decode_attention(q, k, v, bt, cl, d ** -0.5, ks, torch.ones_like(vs)),
        "one token short": ext.decode_attention(q, k, v, bt, cl - 1, d ** -0.5, ks, vs),
        "pages shifted": ext.decode_attention(q, k, v, bt.roll(1, 1), cl, d ** -0.5, ks, vs),
    }
    for name, got in bugs.items():
        assert rel_err(got, want) > 50 * ATTN_TOL, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_kv_store_equals_reference_bit_for_bit(ext, dtype):
    heads, kv_heads, d, t = 9, 3, 64, 7
    g = torch.Generator().manual_seed(4)
    cos, sin = torch.randn(512, d, generator=g), torch.randn(512, d, generator=g)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    pos = torch.tensor([0, 5, 511, 3, 3, 100, 7])
    slots = torch.tensor([0, 17, -1, 40, 41, 63, 2])                 # -1: skipped
    shape = (4, PAGE, kv_heads, d)
    caches = [torch.full(shape, 0.5).to(dtype) for _ in range(4)]
    a, b = qkv.clone(), qkv.clone()
    ext.rope_kv_store_(a, pos, cos, sin, caches[0], caches[1], slots, heads, kv_heads)
    ref.rope_kv_store_(b, pos, cos, sin, caches[2], caches[3], slots, heads, kv_heads)
    assert torch.equal(a, b) and not torch.equal(a, qkv)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(a[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])   # v is not rotated
    no_cache = qkv.clone()
    ext.rope_kv_store_(no_cache, pos, cos, sin, None, None, slots, heads, kv_heads)
    assert torch.equal(no_cache, a)
    swapped = qkv.clone()                                             # the rotation's halves the wrong way round
    ext.rope_kv_store_(swapped, pos, cos, -sin, None, None, slots, heads, kv_heads)
    assert not torch.equal(swapped, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary,norm", [(32, True), (64, True), (32, False)], ids=["partial+norm", "norm", "partial"])
def test_rope_norm_kv_store_matches_reference(ext, dtype, rotary, norm):
    """QK-norm per head, then rope on the first `rotary` of each 64-wide head (GLM-4.5: half; Qwen3: all)."""
    heads, kv_heads, d, t = 6, 2, 64, 5
    g = torch.Generator().manual_seed(6)
    cos, sin = torch.randn(256, rotary, generator=g), torch.randn(256, rotary, generator=g)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * 3
    qn, kn = (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5) if norm else (None, None)
    pos, slots = torch.tensor([0, 9, 255, 4, 4]), torch.tensor([0, 17, -1, 40, 63])
    shape = (4, PAGE, kv_heads, d)
    caches = [torch.full(shape, 0.5).to(dtype) for _ in range(4)]
    a, b = qkv.clone(), qkv.clone()
    ext.rope_norm_kv_store_(a, pos, cos, sin, caches[0], caches[1], slots, heads, kv_heads, d, qn, kn, 1e-6)
    ref.rope_norm_kv_store_(b, pos, cos, sin, caches[2], caches[3], slots, heads, kv_heads, d, qn, kn, 1e-6)
    assert rel_err(a, b) < 1e-6 and not torch.equal(a, qkv)
    assert rel_err(caches[0].float(), caches[2].float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(a[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])   # v untouched
    if not norm and rotary < d:                                                          # the rest of each head too
        x = qkv[:, : (heads + kv_heads) * d].view(t, -1, d)
        assert torch.equal(a[:, : (heads + kv_heads) * d].view(t, -1, d)[..., rotary:], x[..., rotary:])
    if norm:                                                          # q and k norms the wrong way round: caught
        c = qkv.clone()
        ext.rope_norm_kv_store_(c, pos, cos, sin, None, None, slots, heads, kv_heads, d, kn, qn, 1e-6)
        assert rel_err(c, b) > 1e-3
    with pytest.raises(RuntimeError, match="rotary dim 96 must be even and <= head_dim 64"):
        ext.rope_norm_kv_store_(qkv.clone(), pos, torch.randn(256, 96), torch.randn(256, 96), None, None, slots,
                                heads, kv_heads, d, qn, kn, 1e-6)


def store_both(ext, qkv, pos, cos, sin, slots, heads, kv_heads, dtype, scale_dtype):
    """qkv's rows stored by the C++ rope op into caches[0:2] and by the reference into caches[2:4] (four 4-page
    pools of `dtype`, scales of `scale_dtype`); asserts the rotated rows, the stored bytes and the scales equal.
    -> (caches, scales)."""
    d = cos.shape[1]
    shape = (4, PAGE, kv_heads, d)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(4)]
    scales = [torch.ones(shape[:3], dtype=scale_dtype) for _ in range(4)]
    a, b = qkv.clone(), qkv.clone()
    ext.rope_kv_store_(a, pos, cos, sin, caches[0], caches[1], slots, heads, kv_heads, scales[0], scales[1])
    ref.rope_kv_store_(b, pos, cos, sin, caches[2], caches[3], slots, heads, kv_heads, scales[2], scales[3])
    assert torch.equal(a, b)
    for x, y in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(scales[0], scales[2]) and torch.equal(scales[1], scales[3])
    return caches, scales


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_rope_kv_store_quantizes_fp8_pages_as_the_reference_bit_for_bit(ext, scale_dtype):
    """The fp8 store in the rope op (a scale per token-head, e4m3 round-to-nearest-even) writes kernels.kv_store's
    bytes, on rows that hit every e4m3 case: ties, subnormals, the 448 clamp, zeros, negative zero."""
    heads, kv_heads, d, t = 9, 3, 64, 9
    g = torch.Generator().manual_seed(8)
    cos, sin = torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * torch.logspace(-4, 3, t)[:, None]
    v0 = (heads + kv_heads) * d
    grid = torch.tensor([2.0 ** e * (1 + m / 8) for e in range(-9, 9) for m in range(8)])
    qkv[0, v0:v0 + d] = grid[:d] * torch.where(torch.arange(d) % 2 == 0, 1.0, -1.0)   # representable values
    qkv[1, v0:v0 + d] = (grid[:d] + grid[1:d + 1]) / 2                               # exact ties
    qkv[2, v0:v0 + d] = 0.0
    qkv[2, v0] = -0.0
    qkv[3, v0:v0 + d] = torch.linspace(-1e-5, 1e-5, d)                               # subnormal-sized
    pos = torch.arange(t) * 3
    slots = torch.tensor([0, 17, -1, 40, 41, 63, 2, 5, 6])
    caches, scales = store_both(ext, qkv, pos, cos, sin, slots, heads, kv_heads, FP8, scale_dtype)
    assert caches[1].view(torch.uint8).flatten(0, 1)[17].ne(0).any()       # the tie row was written
    with pytest.raises(RuntimeError, match="an fp8/int8 cache needs k_scale"):
        ext.rope_kv_store_(qkv.clone(), pos, cos, sin, caches[0], caches[1], slots, heads, kv_heads)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_rope_kv_store_quantizes_int8_pages_as_the_reference_bit_for_bit(ext, scale_dtype):
    """The int8 store in the rope op (a scale per token-head = amax / 127, round half to even, clamp to +-127)
    writes kernels.kv_store's bytes, on rows built to hit exact ties (k + 0.5 steps of the row's scale), the
    amax value itself, zeros and tiny rows. A round-half-away or a floor would differ on the tie rows."""
    heads, kv_heads, d, t = 9, 3, 64, 8
    g = torch.Generator().manual_seed(18)
    cos, sin = torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * torch.logspace(-4, 3, t)[:, None]
    v0 = (heads + kv_heads) * d
    # amax 127 -> scale exactly 1.0 in bf16 and fp32: values k + 0.5 are exact ties
    ties = torch.arange(d, dtype=torch.float32) * 2 - 62.5   # 2k + 0.5: even rounding goes toward zero
    ties[0] = 127.0
    qkv[0, v0:v0 + d] = ties
    qkv[0, v0 + d:v0 + 2 * d] = -ties
    qkv[1, v0:v0 + d] = 0.0
    qkv[2, v0:v0 + d] = torch.linspace(-1e-9, 1e-9, d)
    pos = torch.arange(t) * 3
    slots = torch.tensor([0, 17, 40, -1, 41, 63, 2, 5])
    caches, scales = store_both(ext, qkv, pos, cos, sin, slots, heads, kv_heads, INT8, scale_dtype)
    tie_row = caches[1].flatten(0, 1)[0, 0]
    assert tie_row[0] == 127 and tie_row[1] == -60 and tie_row[2] == -58     # -60.5 -> -60, -58.5 -> -58 (even)
    assert int(caches[1].abs().max()) == 127 and caches[1].flatten(0, 1)[40].abs().max() <= 127


@pytest.mark.parametrize("op", ["rope_kv_store_", "rope_norm_kv_store_"])
def test_the_hadamard_rotation_matches_the_reference_and_keeps_attention(ext, op):
    """hadamard=True rotates every q and k head by H / sqrt(head_dim) after rope, the reference's bits; fp8 pages
    of rotated k attended by rotated q give the unrotated fp32 attention, closer than unrotated fp8 does."""
    heads, kv_heads, d, t = 9, 3, 64, 40
    g = torch.Generator().manual_seed(12)
    cos, sin = torch.ones(64, d), torch.zeros(64, d)       # rope as the identity: the outlier channel stays put
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    # outlier channels in q and k alike (as real models have): fp8's error on them dominates q . k, unless rotated
    for ch, in_q, in_k in ((5, 8.0, 12.0), (37, 6.0, 9.0), (12, 5.0, 7.0)):
        qkv[:, : heads * d].view(t, heads, d)[..., ch] += in_q
        qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)[..., ch] += in_k
    pos, slots = torch.arange(t), torch.arange(t)
    norm = (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5) if op == "rope_norm_kv_store_" else None

    def store(fn, x, dtype, hadamard):
        shape = (4, PAGE, kv_heads, d)
        k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        ks, vs = (torch.ones(shape[:3], dtype=torch.bfloat16), torch.ones(shape[:3], dtype=torch.bfloat16)) \
            if dtype == FP8 else (None, None)
        if norm is None:
            getattr(fn, op)(x, pos, cos, sin, k, v, slots, heads, kv_heads, ks, vs, hadamard)
        else:
            getattr(fn, op)(x, pos, cos, sin, k, v, slots, heads, kv_heads, d, norm[0], norm[1], 1e-6, ks, vs,
                            hadamard)
        return x, k, v, ks, vs

    a, b = store(ext, qkv.clone(), FP8, True), store(ref, qkv.clone(), FP8, True)
    if norm is None:    # the plain op is bit-exact; the QK-norm variant's norm sums in another order (tolerance)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
        assert torch.equal(a[3], b[3])
    else:
        assert rel_err(a[0], b[0]) < 1e-5
    exact = store(ext, qkv.clone(), torch.float32, False)
    plain = store(ext, qkv.clone(), FP8, False)

    def scores(x, k, v, ks, vs):   # q . k of every (query, key) pair of kv head 0, k as stored (dequantized)
        q = x[:, : heads * d].view(t, heads, d)[:, 0]
        keys = k.flatten(0, 1)[:t, 0].float() * (ks.flatten(0, 1)[:t, 0, None].float() if ks is not None else 1.0)
        return q @ keys.T

    want = scores(*exact)
    rms = lambda x: float((x - want).pow(2).mean().sqrt())   # noqa: E731
    err_rotated, err_plain = rms(scores(*a)), rms(scores(*plain))
    assert err_rotated < 0.7 * err_plain, (err_rotated, err_plain)     # measured: about 0.55x
    with pytest.raises(RuntimeError, match="power-of-two head_dim"):
        x = torch.randn(2, (heads + 2 * kv_heads) * 48)
        ext.rope_kv_store_(x, pos[:2], cos[:, :48].contiguous(), sin[:, :48].contiguous(), None, None, slots[:2],
                           heads, kv_heads, None, None, True)


def _packed(q_lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return cu


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
def test_prefill_attention_matches_reference_on_every_kv_dtype(ext, dtype, heads, kv_heads):
    d, num_pages = 64, 40
    k, v, ks, vs = pool(num_pages, kv_heads, d, dtype)
    lens, q_lens = [17, 160, 33, 300], [17, 40, 1, 35]         # whole prompts, suffixes after a prefix, one row
    bt, cl = tables(lens, num_pages, 20)
    cu = _packed(q_lens)
    q = torch.randn(int(cu[-1]), heads, d, generator=torch.Generator().manual_seed(9))
    got = ext.prefill_attention(q, k, v, bt, cu, cl, d ** -0.5, ks, vs)
    want = ref.prefill_attention(q, k, v, bt, cu, cl, d ** -0.5, ks, vs)
    assert got.shape == want.shape == q.shape
    assert rel_err(got, want) < ATTN_TOL
    bugs = {"not causal (a row sees the next key)": ext.prefill_attention(q, k, v, bt, cu, cl + 1, d ** -0.5, ks, vs),
            "one key short": ext.prefill_attention(q, k, v, bt, cu, cl - torch.tensor([0, 1, 1, 1], dtype=torch.int32),
                                                   d ** -0.5, ks, vs)}
    if ks is not None:
        bugs["v scales ignored"] = ext.prefill_attention(q, k, v, bt, cu, cl, d ** -0.5, ks, torch.ones_like(vs))
    for name, bad in bugs.items():
        assert rel_err(bad, want) > 50 * ATTN_TOL, name


@pytest.mark.parametrize("d", [8, 40])
def test_prefill_attention_takes_a_head_dim_that_is_8_mod_16(ext, d):
    """The P @ V tiles are 16 columns wide; a head_dim of 8 mod 16 ends with an 8-column tile."""
    k, v, ks, vs = pool(12, 2, d, FP8)
    bt, cl = tables([100, 37], 12, 7)
    cu = _packed([37, 5])
    q = torch.randn(42, 8, d, generator=torch.Generator().manual_seed(13))
    got = ext.prefill_attention(q, k, v, bt, cu, cl, 0.3, ks, vs)
    assert rel_err(got, ref.prefill_attention(q, k, v, bt, cu, cl, 0.3, ks, vs)) < ATTN_TOL


@pytest.mark.parametrize("dtype", [torch.float32, FP8, INT8])
def test_prefill_rows_do_not_depend_on_their_chunk_or_batch(ext, dtype):
    """A row's result is the same bits whether its prompt is prefilled whole, as a suffix after a cached prefix,
    in any chunk split, or beside other sequences: what makes a prefix-cache hit change no answer. (SDPA, the
    reference, computes 32-row blocks: its rows differ when a chunk leaves a block of 1-3 rows.)"""
    d, heads, kv_heads, num_pages = 64, 9, 3, 40
    k, v, ks, vs = pool(num_pages, kv_heads, d, dtype)
    bt, cl = tables([300, 120], num_pages, 20)
    q = torch.randn(300, heads, d, generator=torch.Generator().manual_seed(10))
    whole = ext.prefill_attention(q, k, v, bt[:1], _packed([300]), cl[:1], 0.125, ks, vs)
    for start in (1, 2, 3, 16, 33, 161, 298, 299):           # the suffix after a cached prefix of `start` tokens
        part = ext.prefill_attention(q[start:].contiguous(), k, v, bt[:1], _packed([300 - start]), cl[:1], 0.125,
                                     ks, vs)
        assert torch.equal(part, whole[start:]), start
    other = torch.randn(7, heads, d, generator=torch.Generator().manual_seed(11))
    both = ext.prefill_attention(torch.cat((other, q[250:])), k, v, bt.flip(0), _packed([7, 50]),
                                 torch.tensor([120, 300], dtype=torch.int32), 0.125, ks, vs)
    assert torch.equal(both[7:], whole[250:])
    for q_len in (1, 2, 3, 4, 5, 15, 16, 17, 33):               # every block and tile remainder
        part = ext.prefill_attention(q[300 - q_len:].contiguous(), k, v, bt[:1], _packed([q_len]), cl[:1], 0.125,
                                     ks, vs)
        assert torch.equal(part, whole[300 - q_len:]), q_len


def test_norms_and_silu_match_reference(ext):
    g = torch.Generator().manual_seed(5)
    for rows in (1, 8, 33):
        x, res = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g) * 4
        w = torch.rand(576, generator=g) + 0.5
        assert rel_err(ext.rms_norm(res, w, 1e-5), ref.rms_norm(res, w, 1e-5)) < 1e-6
        a, ra, b, rb = x.clone(), res.clone(), x.clone(), res.clone()
        ext.add_rms_norm_(a, ra, w, 1e-5)
        ref.add_rms_norm_(b, rb, w, 1e-5)
        assert torch.equal(ra, rb) and rel_err(a, b) < 1e-6
        assert rel_err(a, ext.rms_norm(res, w, 1e-5)) > 1e-2          # the residual was added before the norm
        gu = torch.randn(rows, 2 * 1536, generator=g) * 6
        assert rel_err(ext.silu_mul(gu), ref.silu_mul(gu)) < 1e-6
    wrong_eps = ext.rms_norm(torch.full((1, 576), 1e-3), torch.ones(576), 1e-5)
    assert rel_err(wrong_eps, ref.rms_norm(torch.full((1, 576), 1e-3), torch.ones(576), 1e-6)) > 1e-3


def test_bad_inputs_name_the_numbers(ext):
    k, v, _, _ = pool(4, 3, 64, torch.float32)
    q = torch.randn(1, 9, 64)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 33 is outside \[0, 32\]"):
        ext.decode_attention(q, k, v, bt, torch.tensor([33], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 0\] = 9 is outside \[0, 4\)"):
        ext.decode_attention(q, k, v, torch.full((1, 2), 9, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                             0.125)
    with pytest.raises(RuntimeError, match="q heads = 8 must be a multiple of kv_heads = 3"):
        ext.decode_attention(torch.randn(1, 8, 64), k, v, bt, torch.tensor([3], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="an fp8/int8 cache needs k_scale"):
        ext.decode_attention(q, k.to(FP8), v.to(FP8), bt, torch.tensor([3], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="an fp8/int8 cache needs k_scale"):
        ext.decode_attention(q, k.to(INT8), v.to(INT8), bt, torch.tensor([3], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match=r"positions\[0\] = 600 is outside \[0, 512\)"):
        ext.rope_kv_store_(torch.randn(1, 15 * 64), torch.tensor([600]), torch.randn(512, 64), torch.randn(512, 64),
                           None, None, torch.tensor([0]), 9, 3)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 64 is outside \[-1, 64\)"):
        ext.rope_kv_store_(torch.randn(1, 15 * 64), torch.tensor([1]), torch.randn(512, 64), torch.randn(512, 64),
                           k, v, torch.tensor([64]), 9, 3)


def test_mode_torch_gives_the_references(monkeypatch):
    monkeypatch.setenv("EDGEINFER_CPU_KERNELS", "torch")
    assert ka.ops() is ref and not ka.enabled()
    monkeypatch.setenv("EDGEINFER_CPU_KERNELS", "ext")
    assert ka.ops() is ka._ext() and ka.enabled()
