"""w4a16_gemm: Triton kernel vs the torch reference, and the reference vs an independent unpack."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_device

from edgeinfer import kernels
from edgeinfer.kernels.w4a16_gemm import (
    DECODE,
    MIDDLE,
    PREFILL,
    group_dequantize_tensor,
    group_quantize_tensor,
    pick_config,
    w4a16_gemm_reference,
    w4a16_gemm_triton,
)

# (M, N, K, group_size): N and M off the block sizes; M picks decode (<=16), middle, prefill (>=256) configs
SHAPES = [(9, 41, 384, 128), (1, 70, 256, 64), (16, 33, 128, 128), (40, 64, 96, 32), (300, 130, 256, 128)]

# The kernel rounds each dequantized weight to the activation dtype before tl.dot (the reference
# keeps fp32), then both round the fp32 sum once: errors are a few ulps of the output dtype,
# relative to the output's magnitude (fp16 eps 2**-10, bf16 eps 2**-7).
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def naive_dequantize(qweight, scales, zeros, group_size):
    n, k2 = qweight.shape
    w = torch.empty(n, 2 * k2)
    for k in range(2 * k2):
        nibble = (qweight[:, k // 2].int() >> (4 * (k % 2))) & 0xF
        zero = zeros[:, k // group_size].float() if zeros is not None else 8.0
        w[:, k] = (nibble - zero) * scales[:, k // group_size].float()
    return w


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_reference_matches_dense_matmul(symmetric):
    n, k, g = 24, 256, 64
    w = torch.randn(n, k)
    qweight, scales, zeros = group_quantize_tensor(w, g, symmetric)
    dense = naive_dequantize(qweight, scales, zeros, g)
    assert torch.equal(group_dequantize_tensor(qweight, scales, zeros, g), dense)
    # 4 bits per value: the round trip is within half a quantization step of the original
    step = scales.float().repeat_interleave(g, 1)
    assert ((dense - w).abs() <= step * 0.5 + 1e-3 * w.abs().max()).all()
    x = torch.randn(5, k, dtype=torch.float16)
    torch.testing.assert_close(w4a16_gemm_reference(x, qweight, scales, zeros, g),
                               (x.float() @ dense.t()).half(), atol=0, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_kernel_matches_reference(shape, dtype, symmetric):
    m, n, k, g = shape
    qweight, scales, zeros = group_quantize_tensor(torch.randn(n, k), g, symmetric)
    x = torch.randn(m, k, dtype=dtype)
    ref = w4a16_gemm_reference(x, qweight, scales, zeros, g).float()
    out = on_device(w4a16_gemm_triton)(x, qweight, scales, zeros, g)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = TOLERANCE[dtype] * ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=TOLERANCE[dtype])


def test_out_argument_and_strided_activations(monkeypatch):
    qweight, scales, zeros = group_quantize_tensor(torch.randn(41, 256), 128)
    x = torch.randn(256, 7, dtype=torch.float16).t()  # [7, 256], K stride 7: strided loads
    out = torch.full((7, 41), float("nan"), dtype=torch.float16)
    monkeypatch.setenv("EDGEINFER_KERNELS", "triton")
    result = on_device(kernels.w4a16_gemm)(x, qweight, scales, zeros, 128, out=out)
    assert torch.equal(result, out)  # written into out and returned
    ref = w4a16_gemm_reference(x, qweight, scales, zeros, 128)
    torch.testing.assert_close(out, ref, atol=4e-3 * ref.abs().max().item(), rtol=4e-3)


def test_configs_follow_m():
    assert pick_config(1, 128) == DECODE and pick_config(16, 128) == DECODE
    assert pick_config(128, 128) == MIDDLE
    assert pick_config(256, 128) == PREFILL and pick_config(4096, 128) == PREFILL
    assert pick_config(1, 32).block_k == 32  # a K tile never straddles a quantization group


def _args():
    qweight, scales, zeros = group_quantize_tensor(torch.randn(41, 256), 128)
    return dict(x=torch.randn(9, 256, dtype=torch.float16), qweight=qweight, scales=scales, zeros=zeros,
                group_size=128)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(x=a["x"].float()), "x dtype"),
    (lambda a: a.update(qweight=a["qweight"].view(torch.int8)), "qweight dtype"),
    (lambda a: a.update(qweight=a["qweight"].t().contiguous().t()), "qweight must be contiguous"),
    (lambda a: a.update(x=a["x"][:, :128]), r"qweight shape \(41, 128\) must be \[N, K//2\] = \[N, 64\]"),
    (lambda a: a.update(scales=a["scales"].float()), "scales dtype"),
    (lambda a: a.update(scales=a["scales"][:, :1].contiguous()), r"scales shape \(41, 1\)"),
    (lambda a: a.update(zeros=a["zeros"][:-1]), "zeros shape"),
    (lambda a: a.update(group_size=48), "group_size must be a positive multiple of 32"),
    (lambda a: a.update(x=a["x"][:, :192], group_size=128), "K = 192"),
    (lambda a: a.update(out=torch.empty(9, 40, dtype=torch.float16)), r"out shape \(9, 40\)"),
])
def test_bad_launch_raises_before_launch(change, message):
    args = _args()
    change(args)
    with pytest.raises(ValueError, match=message):
        w4a16_gemm_triton(**args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gguf_q4_1_mins_run_as_fp32_zero_points(dtype):
    """W4A16Linear on CUDA runs GGUF Q4_1 (w = q * s + m) through the kernel as (q - z) * s with z = -m / s
    kept in fp32 (an fp16 z would round); a block with s = 0 still gives m."""
    from edgeinfer.backend.model.linear import mins_as_zeros
    from edgeinfer.backend.model.packing import group_dequantize_mins

    n, k, g = 48, 256, 32
    gen = torch.Generator().manual_seed(5)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).half()
    mins = (-torch.rand(n, k // g, generator=gen) * 0.15).half()
    scales[3, 2] = 0.0                                            # a constant block: every weight = its min
    exact = group_dequantize_mins(qweight, scales, mins, g)
    s, z = mins_as_zeros(scales, mins)
    assert z.dtype == torch.float32
    torch.testing.assert_close(group_dequantize_tensor(qweight, s, z, g), exact, rtol=0, atol=1e-6)
    x = torch.randn(5, k, generator=gen).to(dtype)
    out = on_device(w4a16_gemm_triton)(x, qweight, s, z, g)
    ref = (x.float() @ exact.t()).to(dtype)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel <= TOLERANCE[dtype]
