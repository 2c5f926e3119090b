"""kernels.cpu.attn's mla_decode_attention (C++) against its pure-torch reference
(kernels.paged_mla_attention.paged_mla_decode_attention_reference, the same signature in attn_reference): absorbed
MLA decode over latent pages in every stored dtype, a long context split over tasks, query heads split into chunks
when the batch is too small to fill the threads (no bit may change), plausible bugs that the tolerance catches, and
bad inputs named."""

from __future__ import annotations

import pytest
import torch

import edgeinfer.kernels.cpu.attn as ka
from edgeinfer.kernels.cpu import attn_reference as ref
from edgeinfer.kernels.paged_mla_attention import mla_latent_store

FP8, INT8 = torch.float8_e4m3fn, torch.int8
DTYPES = [torch.float32, torch.bfloat16, torch.float16, FP8, INT8]
PAGE = 16
TOL = 2e-5   # fp32 summation order and exp's last bits; each bug below is >= 1e-3


@pytest.fixture(scope="module")
def ext():
    return ka._ext()


def latent_pool(num_pages: int, rank: int, rope: int, dtype: torch.dtype, seed: int = 0):
    """Latent rows [c (rank), k_pe (rope)] stored through the model's own mla_latent_store -> (cache, scale)."""
    g = torch.Generator().manual_seed(seed)
    n, d = num_pages * PAGE, rank + rope
    cache = torch.zeros(num_pages, PAGE, 1, d, dtype=dtype)
    scale = torch.ones(num_pages, PAGE, 1, dtype=torch.bfloat16) if dtype in (FP8, INT8) else None
    rows = torch.randn(n, d, generator=g) * (1 + torch.rand(n, 1, generator=g) * 3)
    mla_latent_store(rows, cache, torch.arange(n), scale)
    return cache, scale


def tables(lens: list[int], num_pages: int, width: int, seed: int = 1):
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    bt = torch.stack([perm.roll(-i * width)[:width] for i in range(len(lens))])
    return bt, torch.tensor(lens, dtype=torch.int32)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


@pytest.fixture
def threads():
    """Four threads, so that one sequence's heads are split into chunks (the C++ op fills the threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


@pytest.mark.parametrize("avx512", ["1", "0"], ids=["avx512-if-present", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [16, 5])
def test_mla_decode_matches_the_reference_on_every_latent_dtype(ext, dtype, heads, avx512, monkeypatch, threads):
    monkeypatch.setenv("EDGEINFER_CPU_AVX512", avx512)
    rank, rope, num_pages = 64, 32, 40
    cache, scale = latent_pool(num_pages, rank, rope, dtype)
    lens = [1, 17, 160, 0, 300]
    bt, cl = tables(lens, num_pages, 20)
    q = torch.randn(len(lens), heads, rank + rope, generator=torch.Generator().manual_seed(2))
    got = ext.mla_decode_attention(q, cache, bt, cl, 0.1, rank, scale)
    want = ref.mla_decode_attention(q, cache, bt, cl, 0.1, rank, scale)
    assert got.shape == want.shape == (len(lens), heads, rank)
    assert rel_err(got, want) < TOL
    assert torch.equal(got[3], torch.zeros(heads, rank))
    # one sequence alone: its heads are split over the threads, and no bit changes
    alone = ext.mla_decode_attention(q[2:3].contiguous(), cache, bt[2:3], cl[2:3], 0.1, rank, scale)
    assert torch.equal(alone[0], got[2])


@pytest.mark.parametrize("dtype", [torch.float32, INT8])
def test_kimi_k2_latent_width_with_a_long_context_split_and_batch_invariance(ext, dtype, threads):
    """Kimi K2's latent row (512 + 64), 1,300 keys (three 512-key splits merged by max and sum), alone and beside a
    short one: the reference's attention, and the same bits either way."""
    rank, rope, num_pages = 512, 64, 90
    cache, scale = latent_pool(num_pages, rank, rope, dtype, seed=4)
    bt, cl = tables([1300, 40], num_pages, 82)
    q = torch.randn(2, 16, rank + rope, generator=torch.Generator().manual_seed(5)) * 0.2
    got = ext.mla_decode_attention(q, cache, bt, cl, (192) ** -0.5, rank, scale)
    want = ref.mla_decode_attention(q, cache, bt, cl, (192) ** -0.5, rank, scale)
    assert rel_err(got, want) < TOL
    alone = ext.mla_decode_attention(q[:1].contiguous(), cache, bt[:1], cl[:1], (192) ** -0.5, rank, scale)
    assert torch.equal(alone[0], got[0])


def test_the_tolerance_fails_plausible_bugs(ext):
    rank, rope, num_pages = 64, 32, 40
    cache, scale = latent_pool(num_pages, rank, rope, FP8)
    bt, cl = tables([33, 150], num_pages, 20)
    q = torch.randn(2, 8, rank + rope, generator=torch.Generator().manual_seed(3))
    want = ref.mla_decode_attention(q, cache, bt, cl, 0.1, rank, scale)
    assert rel_err(ext.mla_decode_attention(q, cache, bt, cl, 0.1, rank, scale), want) < TOL
    no_rope = q.clone()
    no_rope[..., rank:] = 0
    bugs = {
        "scale off by 2%": ext.mla_decode_attention(q, cache, bt, cl, 0.102, rank, scale),
        "row scales ignored": ext.mla_decode_attention(q, cache, bt, cl, 0.1, rank, torch.ones_like(scale)),
        "rope part not scored": ext.mla_decode_attention(no_rope, cache, bt, cl, 0.1, rank, scale),
        "one token short": ext.mla_decode_attention(q, cache, bt, cl - 1, 0.1, rank, scale),
        "pages shifted": ext.mla_decode_attention(q, cache, bt.roll(1, 1), cl, 0.1, rank, scale),
    }
    for name, got in bugs.items():
        assert rel_err(got, want) > 50 * TOL, name
    # v_dim is honoured: a wider value (into the rope columns) is the reference's with that v_dim
    wide = ext.mla_decode_attention(q, cache, bt, cl, 0.1, rank + 16, scale)
    assert rel_err(wide, ref.mla_decode_attention(q, cache, bt, cl, 0.1, rank + 16, scale)) < TOL
    assert rel_err(wide[..., :rank], want) < TOL


def test_bad_inputs_name_the_numbers(ext):
    cache, scale = latent_pool(4, 64, 32, INT8)
    bt, cl = tables([10], 4, 2)
    q = torch.randn(1, 4, 96)
    with pytest.raises(RuntimeError, match=r"v_dim = 96 must be in \(0, 96\)"):
        ext.mla_decode_attention(q, cache, bt, cl, 0.1, 96, scale)
    with pytest.raises(RuntimeError, match="v_dim = 40 .* multiple of 16"):
        ext.mla_decode_attention(q, cache, bt, cl, 0.1, 40, scale)
    with pytest.raises(RuntimeError, match="an fp8/int8 cache needs"):
        ext.mla_decode_attention(q, cache, bt, cl, 0.1, 64, None)
    two_heads = torch.zeros(4, PAGE, 2, 96)
    with pytest.raises(RuntimeError, match="one latent row per token"):
        ext.mla_decode_attention(torch.randn(1, 4, 96), two_heads, bt, cl, 0.1, 64)
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 100 is outside"):
        ext.mla_decode_attention(q, cache, bt, torch.tensor([100], dtype=torch.int32), 0.1, 64, scale)


def _packed(q_lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return cu


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_prefill_matches_the_reference_and_a_row_does_not_depend_on_its_chunk(ext, dtype):
    """The latent-form prefill (causal, values the latent part): the reference's attention on every stored dtype,
    plausible bugs far outside the tolerance, and a prompt's rows the same bits whole or as a suffix after a cached
    prefix (what makes a prefix-cache hit change no answer)."""
    rank, rope, num_pages = 64, 32, 40
    cache, scale = latent_pool(num_pages, rank, rope, dtype)
    lens, q_lens = [17, 160, 33, 300], [17, 40, 1, 35]
    bt, cl = tables(lens, num_pages, 20)
    cu = _packed(q_lens)
    q = torch.randn(int(cu[-1]), 8, rank + rope, generator=torch.Generator().manual_seed(9)) * 0.3
    got = ext.mla_prefill_attention(q, cache, bt, cu, cl, 0.1, rank, scale)
    want = ref.mla_prefill_attention(q, cache, bt, cu, cl, 0.1, rank, scale)
    assert got.shape == want.shape == (q.shape[0], 8, rank)
    assert rel_err(got, want) < TOL
    bugs = {"not causal": ext.mla_prefill_attention(q, cache, bt, cu, cl + 1, 0.1, rank, scale),
            "scale off by 2%": ext.mla_prefill_attention(q, cache, bt, cu, cl, 0.102, rank, scale)}
    if scale is not None:
        bugs["row scales ignored"] = ext.mla_prefill_attention(q, cache, bt, cu, cl, 0.1, rank, torch.ones_like(scale))
    for name, bad in bugs.items():
        assert rel_err(bad, want) > 50 * TOL, name
    whole = ext.mla_prefill_attention(q[-35:].contiguous(), cache, bt[3:], _packed([35]), cl[3:], 0.1, rank, scale)
    for start in (1, 16, 33):
        part = ext.mla_prefill_attention(q[-35 + start:].contiguous(), cache, bt[3:], _packed([35 - start]), cl[3:],
                                         0.1, rank, scale)
        assert torch.equal(part, whole[start:]), start
