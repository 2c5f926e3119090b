"""INT4 packing: quantize -> dequantize round trip, agreement with the kernels' oracle, community layouts."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.backend.model.packing import (
    effective_group_size,
    fake_quantize,
    from_autoawq_gemm,
    from_gptq,
    group_dequantize_tensor,
    group_quantize_tensor,
    to_autoawq_gemm,
    to_gptq,
)


@pytest.mark.parametrize("shape,group", [((9, 128), 128), ((64, 576), 96), ((33, 256), 32)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_round_trip_within_one_step(shape, group, symmetric):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, :group] = 0.0  # an all-zero group gets the minimum scale, not a division by zero
    q, s, z = group_quantize_tensor(w, group, symmetric)
    assert q.dtype == torch.uint8 and q.shape == (shape[0], shape[1] // 2)
    assert s.dtype == torch.float16 and s.shape == (shape[0], shape[1] // group)
    back = group_dequantize_tensor(q, s, z, group)
    step = s.float().repeat_interleave(group, 1)
    # half a step from rounding; fp16 rounding of scale and zero can move the grid by < 1 step at the edges
    assert ((back - w).abs() <= step * 0.5 + 1e-6).float().mean() > 0.99
    assert ((back - w).abs() <= step * 1.0 + 1e-6).all()
    assert torch.equal(fake_quantize(w, group), back) if not symmetric else True


def test_matches_the_per_element_formula():
    # w = (q - zero) * scale per group: check the vectorized packer against the definition, element by element
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    q, s, z = group_quantize_tensor(w, 32)
    for r in range(3):
        for c in range(64):
            grp = w[r, (c // 32) * 32:(c // 32 + 1) * 32]
            sc = ((grp.max() - grp.min()) / 15.0).clamp(min=1e-6).half().float()
            zero = (-grp.min() / sc).round().clamp(0, 15)
            want = int((w[r, c] / sc + zero).round().clamp(0, 15))
            byte = int(q[r, c // 2])
            got = byte & 0xF if c % 2 == 0 else byte >> 4
            assert got == want and float(s[r, c // 32]) == float(sc) and float(z[r, c // 32]) == float(zero)


def test_clip_only_shrinks_range():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    amax = w.abs().amax(-1, keepdim=True)
    q, s, z = group_quantize_tensor(w, 128, clip=amax * 0.5)
    back = group_dequantize_tensor(q, s, z, 128)
    assert (back.abs() <= amax * 0.5 + s.float() * 0.5 + 1e-6).all()   # the rounded zero shifts the grid < 1/2 step


def test_effective_group_size():
    assert effective_group_size(1536, 128) == 128
    assert effective_group_size(576, 128) == 96      # SmolLM2 hidden size
    assert effective_group_size(192, 128) == 96
    with pytest.raises(ValueError, match="in_features=100"):
        effective_group_size(100, 128)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_community_layouts_convert_exactly(fmt):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    q, s, z = group_quantize_tensor(w, 128)
    assert (z > 0).all()   # GPTQ v1 stores zero - 1
    if fmt == "awq":
        back = from_autoawq_gemm(*to_autoawq_gemm(q, s, z))
    else:
        qw, qz, sc, g_idx = to_gptq(q, s, z, 128)
        assert qw.shape == (32, 64) and qz.shape == (2, 8) and sc.shape == (2, 64)
        back = from_gptq(qw, qz, sc, g_idx, 128)
    for a, b in zip((q, s, z), back):
        assert torch.equal(a, b)


def test_gptq_act_order_rejected():
    q, s, z = group_quantize_tensor(torch.randn(8, 256), 128)
    qw, qz, sc, g_idx = to_gptq(q, s, z, 128)
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(qw, qz, sc, g_idx.flip(0), 128)
