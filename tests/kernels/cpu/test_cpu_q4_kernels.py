"""edgeinfer.kernels.cpu (C++ AVX2): each op against its pure-torch reference (kernels.cpu.reference: the same int8
activation quantization bit for bit, the same integer block dots summed in float64), and loosely against the
fp32 dequantized weight; tolerances that a swapped nibble order or a dropped min term fail; the capability
fallback; the served native model on the kernels: greedy equal to the reference ops, logits near the oracle."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

import edgeinfer.kernels.cpu as kc
from edgeinfer.backend.model.linear import Q8Embedding, Q8Linear, W4A16Linear
from edgeinfer.backend.model.packing import group_dequantize_mins
from edgeinfer.kernels.cpu import reference as ref

ROWS = [1, 3, 8, 32, 200]
SHAPES = [(1, 32), (67, 96), (130, 576)]            # [N, K]: odd row counts, K of 1, 3 and 18 blocks


@pytest.fixture(scope="module", autouse=True)
def built():
    kc.ops()   # builds (or loads the cached build); a missing compiler fails here, loudly, rather than skips


def q4_weight(n: int, k: int, group: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.05 + 0.001).half()
    mins = (-torch.rand(n, k // group, generator=g) * 0.4).half()
    mins[0, 0] = 0.3                                                 # a positive min
    return qweight, scales, mins


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    if m * k > 32:
        x[0, :32] = 0.0                                              # an all-zero block: d = 0
    if m > 2:
        x[2, 5] = 40.0                                               # an outlier block
    return x


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32 accumulation order vs float64: within 1e-5 of the output's scale."""
    return bool(((got - want).abs().max() <= 1e-5 * want.abs().max().clamp_min(1.0)).item())


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k", [32, 96, 576])
def test_q8_quantize_equals_reference_bit_for_bit(m, k):
    x = activations(m, k)
    q, d, s = kc.q8_quantize(x)
    rq, rd, rs = ref.q8_quantize(x)
    assert q.dtype == torch.int8 and torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
    assert int(q.abs().max()) == 127 and (float(d[0, 0]) == 0.0) == (m * k > 32)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_q4_1_gemm_matches_reference_and_dequantized_weight(m, n, k):
    qweight, scales, mins = q4_weight(n, k)
    blocks = kc.pack_q4_1(qweight, scales, mins, 32)
    x = activations(m, k)
    got = kc.q4_1_gemm(x, blocks)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert close(got, ref.q4_1_gemm(x, blocks))
    dense = x @ group_dequantize_mins(qweight, scales, mins, 32).t()
    assert float((got - dense).norm() / dense.norm()) < 0.05   # int8 activations (step amax/127; the outlier block: 2.5%)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_q8_0_gemm_matches_reference_and_dequantized_weight(m, n, k):
    g = torch.Generator().manual_seed(3)
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    qweight[-1, :32] = -128                                            # the one value |q| can't hold in int8
    scales = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    x = activations(m, k)
    got = kc.q8_0_gemm(x, qweight, scales)
    assert close(got, ref.q8_0_gemm(x, qweight, scales))
    dense = x @ (qweight.float().reshape(n, -1, 32) * scales.float()[..., None]).reshape(n, k).t()
    assert float((got - dense).norm() / dense.norm()) < 0.05


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES + [(8, 64), (960, 576)])
def test_q4_1x8_gemm_matches_reference_and_the_plain_kernel(m, n, k):
    """The interleaved layout (8 rows, N padded to a multiple of 8) computes what the plain Q4_1 blocks do."""
    blocks = kc.pack_q4_1(*q4_weight(n, k), 32)
    packed = kc.pack_q4_1x8(blocks)
    assert packed.shape == ((n + 7) // 8, k // 32 * 160) and torch.equal(kc.unpack_q4_1x8(packed, n), blocks)
    x = activations(m, k)
    got = kc.q4_1x8_gemm(x, packed, n)
    assert got.shape == (m, n) and close(got, ref.q4_1x8_gemm(x, packed, n)) and close(got, ref.q4_1_gemm(x, blocks))
    assert close(got, kc.q4_1_gemm(x, blocks))
    want = group_dequantize_mins(*q4_weight(n, k), 32)
    assert torch.equal(kc.q4_1x8_dequant(packed, n, torch.empty(n, k)), want)
    assert torch.equal(ref.q4_1x8_dequant(packed, n, torch.empty(n, k)), want)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES + [(960, 576)])
def test_q8_0x8_gemm_matches_reference_and_the_plain_kernel(m, n, k):
    g = torch.Generator().manual_seed(4)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    qweight[0, :4] = -128                                                       # |q| = 128 in one chunk
    scales = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    qs, d = kc.pack_q8_0x8(qweight, scales)
    assert qs.shape == ((n + 7) // 8, k // 32 * 256) and d.shape == ((n + 7) // 8, k // 32 * 8)
    q, s = kc.q8_0x8_rows(qs, d, n=n)
    assert torch.equal(q, qweight) and torch.equal(s, scales)
    x = activations(m, k)
    got = kc.q8_0x8_gemm(x, qs, d, n)
    want = ref.q8_0_gemm(x, qweight, scales)
    assert got.shape == (m, n) and close(got, want) and close(ref.q8_0x8_gemm(x, qs, d, n), want)
    r0 = n // 3
    plain = kc.q8_0_dequant(qweight[r0:].contiguous(), scales[r0:].contiguous(), torch.empty(n - r0, k))
    assert torch.equal(kc.q8_0x8_dequant(qs, d, r0, torch.empty(n - r0, k)), plain)
    assert torch.equal(ref.q8_0x8_dequant(qs, d, r0, torch.empty(n - r0, k)), plain)


def _best_isa_by_cpuinfo() -> int:
    flags = kc._cpu_flags()
    if {"avx512_vnni", "avx512vl", "avx512bw", "avx512dq"} <= flags:
        return 3
    return 1 if "avx_vnni" in flags else 0


@pytest.fixture
def isa_levels():
    """The x8 GEMMs' instruction-set levels this CPU runs (0 AVX2 .. its best, without the ones it lacks: AMD
    Zen 4 has AVX512-VNNI but not AVX-VNNI), restored to the best after; the 512-bit level from one row on (by
    default it starts at x8_z_min_rows() rows)."""
    best, zmin = kc.x8_isa(), kc.x8_z_min_rows()
    kc.x8_z_min_rows(1)
    try:
        yield sorted({kc.x8_isa(level) for level in range(best + 1)})
    finally:
        kc.x8_isa(best)
        kc.x8_z_min_rows(zmin)


def test_x8_isa_defaults_to_the_best_this_cpu_has(isa_levels):
    assert isa_levels[-1] == _best_isa_by_cpuinfo()
    assert kc.x8_isa(0) == 0 and kc.x8_isa(99) == isa_levels[-1] and kc.x8_isa() == isa_levels[-1]
    has_avx_vnni = "avx_vnni" in kc._cpu_flags()
    assert (1 in isa_levels) == has_avx_vnni
    assert kc.x8_isa(1) == (1 if has_avx_vnni else 0)     # a level this CPU lacks is never selected


@pytest.mark.parametrize("m", [1, 3, 5, 32])
@pytest.mark.parametrize("n,k", [(1, 32), (67, 96), (136, 576)])
def test_q4_1x8_gemm_residual_matches_its_reference_and_is_closer_to_exact(m, n, k):
    """Two int8 passes (q(x), then q of what it rounded away): the reference's numbers, every ISA level the same
    bits, and far closer to the exact fp32 product than one pass."""
    qweight, scales, mins = q4_weight(n, k, seed=5)
    packed = kc.pack_q4_1x8(kc.pack_q4_1(qweight, scales, mins, 32))
    x = activations(m, k)
    got = kc.q4_1x8_gemm_residual(x, packed, n)
    assert got.shape == (m, n) and close(got, ref.q4_1x8_gemm_residual(x, packed, n))
    exact = x @ kc.q4_1x8_dequant(packed, n, torch.empty(n, k)).t()
    one_pass = kc.q4_1x8_gemm(x, packed, n)
    err2, err1 = float((got - exact).norm() / exact.norm()), float((one_pass - exact).norm() / exact.norm())
    assert err2 < 1e-4 and err2 * 30 < err1, (err2, err1)
    best = kc.x8_isa()
    try:
        for level in sorted({kc.x8_isa(lv) for lv in range(best + 1)}):
            kc.x8_isa(level)
            assert torch.equal(kc.q4_1x8_gemm_residual(x, packed, n), got), kc.ISA_NAMES[level]
    finally:
        kc.x8_isa(best)


@pytest.mark.parametrize("m", [1, 4, 9])
@pytest.mark.parametrize("tau", [0.3, 0.5, 1.0])
def test_q4_1x8_gemm_residual_second_pass_on_the_largest_blocks_only(m, tau):
    """tau > 0: the second pass only on the blocks whose scale is >= tau x the row's largest. The reference's
    numbers, the same bits on every ISA level, between one pass and two in accuracy; a row's result does not
    depend on the other rows (batch invariance); out-of-range tau is refused by both."""
    n, k = 67, 576
    qweight, scales, mins = q4_weight(n, k, seed=7)
    packed = kc.pack_q4_1x8(kc.pack_q4_1(qweight, scales, mins, 32))
    x = activations(m, k)
    x[:, 37] *= 40.0   # an outlier channel: its block's scale dwarfs the others'
    got = kc.q4_1x8_gemm_residual(x, packed, n, tau)
    assert close(got, ref.q4_1x8_gemm_residual(x, packed, n, tau))
    exact = x @ kc.q4_1x8_dequant(packed, n, torch.empty(n, k)).t()
    def err(y):
        return float((y - exact).norm() / exact.norm())
    full, one = err(kc.q4_1x8_gemm_residual(x, packed, n)), err(kc.q4_1x8_gemm(x, packed, n))
    assert full <= err(got) < one, (full, err(got), one)
    for i in range(m):   # each row alone gives the same bits as in the batch
        assert torch.equal(kc.q4_1x8_gemm_residual(x[i:i + 1].contiguous(), packed, n, tau), got[i:i + 1])
    best = kc.x8_isa()
    try:
        for level in sorted({kc.x8_isa(lv) for lv in range(best + 1)}):
            kc.x8_isa(level)
            assert torch.equal(kc.q4_1x8_gemm_residual(x, packed, n, tau), got), kc.ISA_NAMES[level]
    finally:
        kc.x8_isa(best)
    for bad in (-0.1, 1.5):
        with pytest.raises(RuntimeError, match="tau must be in"):
            kc.q4_1x8_gemm_residual(x, packed, n, bad)
        with pytest.raises(ValueError, match="tau must be in"):
            ref.q4_1x8_gemm_residual(x, packed, n, bad)


def test_second_pass_setting_is_validated(monkeypatch):
    monkeypatch.setenv(kc.SECOND_PASS_ENV, "0.25")
    assert kc.second_pass_tau() == 0.25
    for bad in ("1.5", "-1", "half", "nan"):
        monkeypatch.setenv(kc.SECOND_PASS_ENV, bad)
        with pytest.raises(ValueError, match=kc.SECOND_PASS_ENV):
            kc.second_pass_tau()
    monkeypatch.delenv(kc.SECOND_PASS_ENV)
    assert kc.second_pass_tau() == kc.SECOND_PASS_DEFAULT


def test_activations_mode_is_validated(monkeypatch):
    monkeypatch.setenv(kc.ACTIVATIONS_ENV, "int4")
    with pytest.raises(ValueError, match="EDGEINFER_CPU_ACTIVATIONS='int4'; expected one of int8x2, int8"):
        kc.activations()


@pytest.mark.parametrize("m", [1, 3, 4, 5, 32])
@pytest.mark.parametrize("n,k", [(1, 32), (8, 64), (67, 96), (130, 576), (136, 576)])
def test_x8_gemms_on_every_isa_level_are_the_avx2_kernels_bit_for_bit(isa_levels, m, n, k):
    """VNNI (256-bit, and 512-bit on pairs of groups, the Q8 head through the unsigned-offset dot) computes the
    same int32 block dots and the same float ops as the AVX2 maddubs kernels: equal outputs, not merely close.
    Extremes included: Q4 nibbles all 15 against activations of +-127 (the AVX2 int16 sums' limit), Q8 weights
    of -128 and +127 against +-127; n odd groups (the 512-bit path's single last group) and padded columns."""
    g = torch.Generator().manual_seed(7)
    qweight, scales, mins = q4_weight(n, k, seed=5)
    qweight[0] = 0xFF
    blocks = kc.pack_q4_1(qweight, scales, mins, 32)
    packed = kc.pack_q4_1x8(blocks)
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    q8[0, :32] = -128
    q8[-1, :32] = 127
    s8 = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    qs, d = kc.pack_q8_0x8(q8, s8)
    x = activations(m, k)
    x[0, :32] = torch.where(torch.arange(32) % 2 == 0, 3.0, -3.0)   # a block quantized to exactly +-127
    outs4, outs8 = [], []
    for level in isa_levels:
        assert kc.x8_isa(level) == level
        outs4.append(kc.q4_1x8_gemm(x, packed, n))
        outs8.append(kc.q8_0x8_gemm(x, qs, d, n))
    assert close(outs4[0], ref.q4_1x8_gemm(x, packed, n)) and close(outs8[0], ref.q8_0x8_gemm(x, qs, d, n))
    for i, level in enumerate(isa_levels[1:], start=1):
        assert torch.equal(outs4[i], outs4[0]), f"q4_1x8 at level {kc.ISA_NAMES[level]}"
        assert torch.equal(outs8[i], outs8[0]), f"q8_0x8 at level {kc.ISA_NAMES[level]}"


def test_interleaved_embedding_looks_up_the_same_rows():
    g = torch.Generator().manual_seed(6)
    qweight = torch.randint(-128, 128, (67, 96), dtype=torch.int8, generator=g)
    scales = (torch.rand(67, 3, generator=g) * 0.01).half()
    emb = Q8Embedding(qweight, scales)
    rows = torch.tensor([0, 66, 7, 8, 7, 65])
    want, everything = emb.index_select(0, rows), emb.dequantize()
    head = Q8Linear.tied_to(emb)
    assert emb.interleaved and emb.shape == (67, 96) and head.qs.data_ptr() == emb.qweight.data_ptr()
    assert torch.equal(emb.index_select(0, rows), want) and torch.equal(emb.dequantize(), everything)


@pytest.mark.parametrize("group", [32, 64])
def test_pack_and_dequant_are_gguf_values_bit_for_bit(group):
    qweight, scales, mins = q4_weight(37, 192, group)
    blocks = kc.pack_q4_1(qweight, scales, mins, group)
    assert blocks.shape == (37, 192 // 32 * 20) and blocks.dtype == torch.uint8
    want = group_dequantize_mins(qweight, scales, mins, group)
    assert torch.equal(kc.q4_1_dequant(blocks, torch.empty(37, 192)), want)
    assert torch.equal(ref.q4_1_dequant(blocks, torch.empty(37, 192)), want)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES + [(960, 576)])
def test_q8_0x8_gemm_exact_matches_reference_and_beats_int8_on_outlier_channels(m, n, k):
    """Channels taken out of the int8 quantization: the kernel equals its reference (zeroed before quantizing,
    added back in float64 against the exact columns), the columns are the table's values bit for bit, and with
    outlier channels the result is several times nearer the fp32 product than plain int8 activations."""
    g = torch.Generator().manual_seed(6)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    qs, d = kc.pack_q8_0x8(qweight, scales)
    w = (qweight.float().reshape(n, -1, 32) * scales.float()[..., None]).reshape(n, k)
    idx = torch.tensor(sorted({0, k // 2 + 1, k - 1}), dtype=torch.int64)
    cols = kc.q8_0x8_columns(qs, d, idx)
    assert cols.shape == ((n + 7) // 8, idx.numel(), 8)
    assert torch.equal(cols.transpose(1, 2).reshape(-1, idx.numel())[:n], w[:, idx])
    x = torch.randn(m, k, generator=g)
    x[:, idx] *= 40.0                                                  # outliers on exactly those channels
    got = kc.q8_0x8_gemm_exact(x, qs, d, n, idx, cols)
    assert got.shape == (m, n) and close(got, ref.q8_0x8_gemm_exact(x, qs, d, n, idx, cols))
    dense = x @ w.t()
    err_exact = float((got - dense).norm() / dense.norm())
    err_int8 = float((kc.q8_0x8_gemm(x, qs, d, n) - dense).norm() / dense.norm())
    assert err_exact < err_int8 / 3, (err_exact, err_int8)
    assert torch.equal(kc.q8_0x8_gemm_exact(x, qs, d, n, idx[:0], cols[:, :0].contiguous()),
                       kc.q8_0x8_gemm(x, qs, d, n))                   # no channels: the plain op
    with pytest.raises(RuntimeError, match="out of"):
        kc.q8_0x8_gemm_exact(x, qs, d, n, torch.tensor([k]), kc.q8_0x8_columns(qs, d, torch.tensor([0])))


def test_q8_linear_keep_exact_switches_the_head_between_both_ops():
    g = torch.Generator().manual_seed(7)
    qweight = torch.randint(-127, 128, (130, 96), dtype=torch.int8, generator=g)
    scales = (torch.rand(130, 3, generator=g) * 0.01).half()
    head = Q8Linear.from_plain(qweight, scales)
    plain_bytes = head.weight_bytes()
    x = activations(5, 96)
    idx = torch.tensor([70, 5])
    head.keep_exact(idx)
    assert head.exact_idx.tolist() == [5, 70] and head.weight_bytes() == plain_bytes + 17 * 2 * 8 * 4
    assert "exact_w" in dict(head.named_buffers())                   # counted by the model's weight_bytes
    assert close(head(x), ref.q8_0x8_gemm_exact(x, head.qs, head.d, 130, head.exact_idx, head.exact_w))
    head.keep_exact(None)
    assert head.exact_idx is None and head.weight_bytes() == plain_bytes
    assert torch.equal(head(x), kc.q8_0x8_gemm(x, head.qs, head.d, 130))


@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_q8_linear_head_on_both_sides_of_its_dense_threshold(monkeypatch, m):
    monkeypatch.setattr("edgeinfer.backend.model.linear.HEAD_CHUNK", 48)              # several chunks, a short last one
    monkeypatch.setattr("edgeinfer.backend.model.linear.HEAD_DENSE_MIN_ROWS", 16)     # both paths (the default: never dense)
    g = torch.Generator().manual_seed(5)
    qweight = torch.randint(-127, 128, (130, 96), dtype=torch.int8, generator=g)
    scales = (torch.rand(130, 3, generator=g) * 0.01).half()
    w = (qweight.float().reshape(130, 3, 32) * scales.float()[..., None]).reshape(130, 96)
    assert torch.equal(kc.q8_0_dequant(qweight, scales, torch.empty(130, 96)), w)
    assert torch.equal(ref.q8_0_dequant(qweight, scales, torch.empty(130, 96)), w)
    x = activations(m, 96)
    head = Q8Linear.from_plain(qweight, scales)
    got = head(x)
    if m >= 16:
        torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)
    else:
        assert close(got, ref.q8_0_gemm(x, qweight, scales))
        assert close(got, ref.q8_0x8_gemm(x, head.qs, head.d, 130))


def test_tolerance_fails_a_swapped_nibble_order_or_a_dropped_min():
    """The `close` bound is tight enough to catch the likely kernel bugs (here built into the reference)."""
    qweight, scales, mins = q4_weight(64, 576)
    x = activations(8, 576)
    good = kc.pack_q4_1(qweight, scales, mins, 32)
    want = ref.q4_1_gemm(x, good)
    b = good.reshape(64, -1, 20).clone()
    b[..., 4:] = (b[..., 4:] >> 4) | (b[..., 4:] << 4)                       # low/high nibble swapped
    assert not close(ref.q4_1_gemm(x, b.reshape(64, -1)), want)
    b = good.reshape(64, -1, 20).clone()
    b[..., 2:4] = 0                                                          # min term dropped (m = 0)
    assert not close(ref.q4_1_gemm(x, b.reshape(64, -1)), want)
    b = good.reshape(64, -1, 20).clone()
    b[..., 4:] = b[..., 4:].roll(1, dims=-1)                                 # bytes off by one
    assert not close(ref.q4_1_gemm(x, b.reshape(64, -1)), want)
    assert close(kc.q4_1_gemm(x, good), want)
    packed = kc.pack_q4_1x8(good)                                            # the x8 layout's likely bugs
    assert close(kc.q4_1x8_gemm(x, packed, 64), want)
    p = packed.reshape(8, -1, 160).clone()
    p[..., 32:] = p[..., 32:].reshape(8, -1, 4, 8, 4).transpose(3, 4).reshape(8, -1, 128)   # rows/bytes transposed
    assert not close(ref.q4_1x8_gemm(x, p.reshape(8, -1), 64), want)
    p = packed.reshape(8, -1, 160).clone()
    p[..., 0:32] = p[..., 0:32].reshape(8, -1, 2, 16).flip(2).reshape(8, -1, 32)           # d and m swapped
    assert not close(ref.q4_1x8_gemm(x, p.reshape(8, -1), 64), want)
    p = packed.reshape(8, -1, 160).clone()
    p[..., 16:32] = 0                                                                      # min term dropped
    assert not close(ref.q4_1x8_gemm(x, p.reshape(8, -1), 64), want)
    p = packed.reshape(8, -1, 160).clone()
    p[..., 32:] = p[..., 32:].reshape(8, -1, 4, 32).roll(1, dims=2).reshape(8, -1, 128)    # chunks rotated
    assert not close(ref.q4_1x8_gemm(x, p.reshape(8, -1), 64), want)


def test_bad_inputs_name_the_shapes():
    blocks = kc.pack_q4_1(*q4_weight(8, 64), 32)
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        kc.q4_1_gemm(torch.zeros(2, 96), blocks)
    with pytest.raises(RuntimeError, match="contiguous CPU float32"):
        kc.q4_1_gemm(torch.zeros(2, 64, dtype=torch.float64), blocks)
    with pytest.raises(RuntimeError, match=r"scales must be contiguous fp16 \[8, 2\]"):
        kc.q8_0_gemm(torch.zeros(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 3).half())
    with pytest.raises(RuntimeError, match=r"weight must be contiguous Byte \[ceil\(9 / 8\) = 2, K/32 \* 160\]"):
        kc.q4_1x8_gemm(torch.zeros(2, 64), kc.pack_q4_1x8(blocks), 9)
    with pytest.raises(RuntimeError, match=r"d must be contiguous fp16 \[1, 16\]"):
        kc.q8_0x8_gemm(torch.zeros(1, 64), torch.zeros(1, 512, dtype=torch.int8), torch.zeros(1, 8).half(), 8)
    with pytest.raises(ValueError, match="group_size 48 is not a multiple of 32"):
        kc.pack_q4_1(*q4_weight(8, 96, 48), 48)


def test_mode_env_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(kc.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="EDGEINFER_CPU_KERNELS='fast'; expected one of auto, ext, torch"):
        kc.enabled()


@pytest.mark.parametrize("acts", kc.ACTIVATIONS)
@pytest.mark.parametrize("m", [1, 8, 19, 67])
def test_w4a16_linear_prepacks_for_the_kernels_on_both_sides_of_the_dense_threshold(monkeypatch, m, acts):
    monkeypatch.setenv(kc.MODE_ENV, "ext")
    monkeypatch.setenv(kc.ACTIVATIONS_ENV, acts)
    monkeypatch.setattr("edgeinfer.backend.model.linear.DENSE_MIN_ROWS", 16)          # both paths (the default: never dense)
    qweight, scales, mins = q4_weight(96, 192, 64)
    bias = torch.randn(96)
    lin = W4A16Linear(qweight, scales, None, 64, bias=bias, mins=mins)
    x = activations(m, 192)
    want = lin(x)                                                      # the reference: exact fp32 weight
    assert lin.prepack() and lin.q4_1x8 is not None and lin.qweight is None and lin.int4pack is None
    got = lin(x)
    assert float((got - want).norm() / want.norm()) < 0.02
    if m >= 16:                                                       # dequantize + GEMM: fp32 rounding only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif acts == "int8x2":                                            # two int8 passes: ~300x closer
        assert lin.residual_activations
        assert close(got - bias, ref.q4_1x8_gemm_residual(x, lin.q4_1x8, 96))
        assert float((got - want).norm() / want.norm()) < 1e-4
    else:
        assert close(got - bias, ref.q4_1x8_gemm(x, lin.q4_1x8, 96))
        assert close(got - bias, ref.q4_1_gemm(x, kc.pack_q4_1(qweight, scales, mins, 64)))


def test_without_a_compiler_auto_falls_back_to_torch_int4_with_one_warning(tmp_path):
    code = (
        "import logging, json, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from backend.model.linear import W4A16Linear\n"
        "from tests.kernels.cpu.test_cpu_q4_kernels import q4_weight\n"
        "lins = [W4A16Linear(*q4_weight(16, 64)[:2], None, 32, mins=q4_weight(16, 64)[2]) for _ in range(3)]\n"
        "print(json.dumps([[l.prepack(), l.q4_1x8 is None, l.int4pack is not None] for l in lins]))\n")
    env = {**__import__("os").environ, "CXX": str(tmp_path / "no-such-compiler"), kc.MODE_ENV: "auto"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[True, True, True]] * 3
    warnings = [ln for ln in r.stderr.splitlines() if "CPU kernels unavailable" in ln]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "torch's int4 GEMM" in warnings[0]
    env[kc.MODE_ENV] = "ext"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "KernelUnavailable" in r.stderr and "no C++ compiler" in r.stderr


# ---------------------------------------------------------------- the served native model


@pytest.fixture(scope="module")
def native_served():
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model

    native_dir = ensure_native_default_model()
    return native_dir, load_model(native_dir)


@pytest.mark.slow
def test_served_native_model_runs_on_the_kernels(native_served):
    _, model = native_served
    linears = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    assert len(linears) == 120 and all(m.q4_1x8 is not None for m in linears)
    head = model.lm_head_linear
    assert isinstance(head, Q8Linear) and head.qs.data_ptr() == model.embed_tokens.qweight.data_ptr()
    assert model.embed_tokens.interleaved and model.embed_tokens.shape == (49152, 576)
    assert model.prepacked_copy_bytes() == 0 and model.weight_bytes() < 100e6   # no fp32 head copy


@pytest.mark.slow
def test_served_head_keeps_its_outlier_channels_exact_and_moves_nearer_the_oracle(native_served, smol_dir,
                                                                                   smol_tokenizer):
    """The served head takes the model's largest-|x| channels of its input out of the int8 quantization
    (docs/QUANTIZATION.md): on 512 held-out tokens its log-probabilities are nearer the GGUF's dequantized fp32
    model (mean KL) than with int8 activations on every channel, and those channels are also the largest on
    that text's final hidden states."""
    from edgeinfer.backend.model.loader import load_model
    from edgeinfer.backend.quant.calib import eval_text, paged_prefill, token_chunks

    _, served = native_served
    head = served.lm_head_linear
    from edgeinfer.backend.model.linear import HEAD_EXACT_CHANNELS

    assert HEAD_EXACT_CHANNELS > 0 and isinstance(head, Q8Linear) and head.exact_idx is not None
    assert head.exact_idx.numel() == HEAD_EXACT_CHANNELS
    oracle = load_model(smol_dir, prepack=False)
    ids = token_chunks(smol_tokenizer.encode(eval_text()[0]), 1, 512)[0]
    want = torch.log_softmax(oracle.compute_logits(paged_prefill(oracle, [ids], "fp32", 16)), -1)
    hidden = paged_prefill(served, [ids], "fp32", 16)
    top = set(hidden.abs().mean(0).topk(2 * HEAD_EXACT_CHANNELS).indices.tolist())
    assert set(head.exact_idx.tolist()) <= top, (head.exact_idx, top)

    def kl() -> float:
        got = torch.log_softmax(served.compute_logits(hidden), -1)
        return float((want.exp() * (want - got)).sum(-1).mean())

    idx = head.exact_idx
    kl_exact = kl()
    try:
        head.keep_exact(None)
        kl_int8 = kl()
    finally:
        head.keep_exact(idx)
    assert kl_exact < 0.85 * kl_int8, (kl_exact, kl_int8)


@pytest.mark.slow
def test_greedy_with_the_kernels_equals_the_reference_ops(native_served, smol_tokenizer, monkeypatch):
    from edgeinfer.backend.engine.engine import LLMEngine
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    _, model = native_served
    chats = ["Name three colors of the rainbow.", "What is 12 times 7?", "Write a haiku about the sea."]
    prompts = [smol_tokenizer.encode_chat([{"role": "user", "content": c}]) for c in chats]

    def greedy() -> list[list[int]]:
        eng = LLMEngine(model, smol_tokenizer, EngineConfig(enable_prefix_cache=False))
        eng.start()

        async def one(i: int, p: list[int]) -> list[int]:
            toks = []
            async for c in eng.generate(GenerateRequest(f"g{i}", p, SamplingParams(temperature=0, max_tokens=12,
                                                                                     ignore_eos=True), "t")):
                toks += c.token_ids
            return toks
        async def every() -> list[list[int]]:
            return list(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))
        try:
            return asyncio.run(every())
        finally:
            eng.stop()

    from edgeinfer.backend.quant.calib import paged_prefill

    fast = greedy()
    assert all(len(t) == 12 for t in fast)
    for name in ("q4_1x8_gemm", "q4_1x8_gemm_residual", "q8_0x8_gemm", "q8_0x8_gemm_exact", "q4_1x8_dequant",
                 "q8_0x8_dequant"):
        monkeypatch.setattr(kc, name, getattr(ref, name))
    # the reference ops, teacher-forced along the kernels' greedy path: every token the kernels chose is the
    # reference's argmax, or within a near-tie of it (a last-bit difference can flip one int8 rounding of an
    # activation in the next layer, so fp32 summation order shows up more than in a float pipeline)
    margins = []
    for p, toks in zip(prompts, fast):
        logits = model.compute_logits(paged_prefill(model, [p + toks], "fp32", 16))[len(p) - 1: -1]
        chosen = logits.gather(1, torch.tensor(toks)[:, None])[:, 0]
        margins += (logits.max(-1).values - chosen).tolist()
    assert max(margins) < 0.05 * float(logits.abs().max()), margins
    assert sum(m == 0 for m in margins) >= 0.9 * len(margins), margins
    slow = greedy()   # the engine on the reference ops
    assert sum(a == b for a, b in zip(fast, slow)) >= 2, (fast, slow)


@pytest.mark.slow
def test_served_kernels_stay_near_the_dequantized_oracle(native_served, smol_dir, smol_tokenizer):
    """int8 activations (llama.cpp's numerics) move the logits more than bf16 did, not the model's predictions:
    the prompt's next-token cross-entropy within 2% of the oracle's (perplexity on 2048 held-out tokens:
    1.0003x with the Q4 linears exact, docs/QUANTIZATION.md) and the teacher-forced greedy tokens mostly equal."""
    from edgeinfer.backend.model.loader import load_model
    from edgeinfer.backend.quant.calib import paged_prefill

    _, served = native_served
    oracle = load_model(smol_dir, prepack=False)
    ids = smol_tokenizer.encode_chat([{"role": "user", "content": "Explain why the sky is blue, in two sentences."}])
    ids += smol_tokenizer.encode("The sky looks blue because air molecules scatter short wavelengths of sunlight "
                                 "more strongly than long ones, so blue light reaches our eyes from every direction.")
    want = oracle.compute_logits(paged_prefill(oracle, [ids], "fp32", 16))
    got = served.compute_logits(paged_prefill(served, [ids], "fp32", 16))
    target = torch.tensor(ids[1:])
    nll = [float(torch.nn.functional.cross_entropy(lg[:-1], target)) for lg in (got, want)]
    assert abs(nll[0] / nll[1] - 1) < 0.02, nll
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9
    assert float((got - want).norm() / want.norm()) < 0.1
