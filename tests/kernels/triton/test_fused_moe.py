"""fused_moe_w4a16: the Triton kernel (token-sorted grouped GEMMs, gate/up + SiLU fused) against its torch
reference, the reference against a per-token loop over dense weights, and the expert sort."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_device

from edgeinfer.kernels.fused_moe import (
    BLOCK_M,
    fused_moe_w4a16_reference,
    fused_moe_w4a16_triton,
    sort_by_expert,
)
from edgeinfer.kernels.w4a16_gemm import group_dequantize_tensor, group_quantize_tensor

# The kernel rounds each dequantized weight and the SiLU product to x's dtype before tl.dot, the reference keeps
# the weights in fp32: a few ulps of the output dtype relative to its magnitude (as test_w4a16_gemm).
TOLERANCE = {torch.float16: 6e-3, torch.bfloat16: 4e-2}

# (tokens, hidden, intermediate, experts, top_k, group): token counts off BLOCK_M, experts left without tokens
SHAPES = [(1, 64, 32, 8, 2, 32), (5, 128, 64, 16, 4, 64), (19, 64, 96, 6, 3, 32)]


def experts(e: int, h: int, inter: int, group: int, symmetric: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1 = [group_quantize_tensor(torch.randn(2 * inter, h, generator=g) * 0.1, group, symmetric) for _ in range(e)]
    w2 = [group_quantize_tensor(torch.randn(h, inter, generator=g) * 0.1, group, symmetric) for _ in range(e)]

    def stack(parts, i):
        return None if parts[0][i] is None else torch.stack([p[i] for p in parts]).contiguous()
    return (stack(w1, 0), stack(w1, 1), stack(w1, 2)), (stack(w2, 0), stack(w2, 1), stack(w2, 2))


def routing(t: int, e: int, k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


def test_sort_by_expert_pads_each_run_and_names_each_tile():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    pairs, tiles = sort_by_expert(ids, 5, block_m=4)
    tk = ids.numel()
    assert pairs.numel() % 4 == 0 and tiles.numel() == pairs.numel() // 4
    for tile, e in enumerate(tiles.tolist()):
        rows = [p for p in pairs[tile * 4:(tile + 1) * 4].tolist() if p < tk]
        if e < 5:
            assert all(int(ids.reshape(-1)[p]) == e for p in rows)
        else:
            assert rows == []
    got = sorted(p for p in pairs.tolist() if p < tk)
    assert got == list(range(tk))                      # every (token, slot) pair exactly once


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_reference_equals_a_per_token_loop_over_dense_weights(symmetric):
    t, h, inter, e, k, group = 7, 64, 32, 8, 3, 32
    (w1q, w1s, w1z), (w2q, w2s, w2z) = experts(e, h, inter, group, symmetric)
    weights, ids = routing(t, e, k)
    x = torch.randn(t, h)
    got = fused_moe_w4a16_reference(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group)
    want = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            ex = int(ids[i, j])
            w1 = group_dequantize_tensor(w1q[ex], w1s[ex], None if w1z is None else w1z[ex], group)
            w2 = group_dequantize_tensor(w2q[ex], w2s[ex], None if w2z is None else w2z[ex], group)
            hh = w1 @ x[i]
            want[i] += weights[i, j] * (w2 @ (torch.nn.functional.silu(hh[:inter]) * hh[inter:]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_kernel_matches_reference(shape, dtype, symmetric):
    t, h, inter, e, k, group = shape
    (w1q, w1s, w1z), (w2q, w2s, w2z) = experts(e, h, inter, group, symmetric)
    weights, ids = routing(t, e, k)
    x = torch.randn(t, h).to(dtype)
    want = fused_moe_w4a16_reference(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group)
    got = on_device(fused_moe_w4a16_triton)(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group)
    assert got.dtype == dtype and got.shape == (t, h)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= TOLERANCE[dtype], f"max error {err:.2e} relative to the output's magnitude"


def test_kernel_takes_fp32_zero_points_from_gguf_mins():
    """Q4_1 mins become fractional fp32 zero points (linear.mins_as_zeros): the kernel reads them as fp32."""
    t, h, inter, e, k, group = 4, 64, 32, 4, 2, 32
    (w1q, w1s, w1z), (w2q, w2s, w2z) = experts(e, h, inter, group, False)
    w1z, w2z = (w1z.float() + 0.37).contiguous(), (w2z.float() - 0.21).contiguous()
    weights, ids = routing(t, e, k)
    x = torch.randn(t, h).half()
    want = fused_moe_w4a16_reference(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group)
    got = on_device(fused_moe_w4a16_triton)(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group)
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) <= TOLERANCE[torch.float16]


def test_tolerance_catches_a_wrong_expert():
    """The bound above is tight enough to fail a kernel that ran one pair through the wrong expert."""
    t, h, inter, e, k, group = 5, 64, 32, 8, 2, 32
    (w1q, w1s, w1z), (w2q, w2s, w2z) = experts(e, h, inter, group, False)
    weights, ids = routing(t, e, k)
    x = torch.randn(t, h).half()
    want = fused_moe_w4a16_reference(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group)
    wrong_ids = ids.clone()
    wrong_ids[2, 0] = (wrong_ids[2, 0] + 1) % e if (wrong_ids[2, 0] + 1) % e not in ids[2] else (wrong_ids[2, 0] + 2) % e
    wrong = fused_moe_w4a16_reference(x, weights, wrong_ids, w1q, w1s, w1z, w2q, w2s, w2z, group)
    assert float((wrong.float() - want.float()).abs().max() / want.float().abs().max()) > TOLERANCE[torch.float16]


def test_bad_shapes_name_what_was_expected():
    (w1q, w1s, w1z), (w2q, w2s, w2z) = experts(4, 64, 32, 32, False)
    weights, ids = routing(3, 4, 2)
    with pytest.raises(ValueError, match=r"w1 qweight .* must be \[E, 2I, H//2\]"):
        fused_moe_w4a16_reference(torch.randn(3, 96), weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, 32)
    with pytest.raises(ValueError, match="ids"):
        fused_moe_w4a16_reference(torch.randn(3, 64), weights, ids[:2], w1q, w1s, w1z, w2q, w2s, w2z, 32)
    assert BLOCK_M >= 16   # tl.dot needs 16-row tiles
