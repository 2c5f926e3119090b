"""KVFormat (backend/engine/kv_pool.py): the one place the KV dtype's name, scales and size are derived."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.kv_pool import KV_DTYPES, KVFormat


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_name_and_dtype_round_trip(name):
    fmt = KVFormat(name)
    assert KVFormat.of(fmt.dtype) == fmt
    assert EngineConfig(kv_dtype=name).resolve_kv_dtype(torch.float32) == fmt.dtype


def test_auto_is_the_model_dtype():
    assert KVFormat.resolve("auto", torch.bfloat16) == KVFormat("bf16")
    assert EngineConfig().resolve_kv_dtype(torch.float16) == torch.float16


def test_only_fp8_and_int8_carry_bf16_scales_per_token_head():
    fp8, bf16, int8 = KVFormat("fp8_e4m3"), KVFormat("bf16"), KVFormat("int8")
    assert (fp8.scaled, fp8.scale_dtype, fp8.scale_layout) == (True, torch.bfloat16, "per_token_kv_head_bf16")
    assert (int8.scaled, int8.scale_dtype, int8.scale_layout) == (True, torch.bfloat16, "per_token_kv_head_bf16")
    assert int8.bytes_per_token(30, 3, 64) == fp8.bytes_per_token(30, 3, 64)
    assert (bf16.scaled, bf16.scale_dtype, bf16.scale_layout) == (False, None, "none")
    # 30 layers x 3 kv heads x 64 dims (SmolLM2-135M): k and v, plus a 2-byte scale per token-head for fp8
    assert bf16.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 64 * 2
    assert fp8.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * (64 + 2)
    assert KVFormat("fp32").bytes_per_token(30, 3, 64) == 2 * bf16.bytes_per_token(30, 3, 64)


@pytest.mark.parametrize("bad", ["fp4", "float8_e4m3fn", ""])
def test_a_bad_name_is_refused_by_value(bad):
    with pytest.raises(ValueError, match=f"kv_dtype={bad!r} is invalid: expected auto or one of fp32, bf16"):
        KVFormat(bad)
    with pytest.raises(ValueError, match=f"kv_dtype={bad!r}"):
        EngineConfig(kv_dtype=bad)


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8", "bf16"])
def test_the_pool_is_allocated_per_the_format(name):
    from types import SimpleNamespace

    from edgeinfer.backend.engine.kv_pool import allocate_pool

    fmt = KVFormat(name)
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8)
    pool = allocate_pool(fmt, num_pages=5, page_size=4, model_cfg=cfg, device="cpu")
    assert len(pool) == 3
    for kv in pool:
        assert kv.k.shape == kv.v.shape == (5, 4, 2, 8) and kv.k.dtype == kv.v.dtype == fmt.dtype
        if fmt.scaled:
            assert kv.k_scale.dtype == kv.v_scale.dtype == torch.bfloat16 and kv.k_scale.shape == (5, 4, 2)
            assert bool((kv.k_scale == 1).all()) and bool((kv.v_scale == 1).all())
        else:
            assert kv.k_scale is None and kv.v_scale is None
    per_token = sum(t[0, 0].numel() * t.element_size() for kv in pool for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)
                    if t is not None)
    assert per_token == fmt.bytes_per_token(3, 2, 8)


def test_fp8_pages_of_a_power_of_two_head_dim_are_hadamard_rotated_and_named_so():
    """The rotation changes what a page holds, so it is in the format's identity: page keys, headers and
    BackendInfo.kv_format never let a rotated and an unrotated fp8 page stand in for each other."""
    rotated = KVFormat.resolve("fp8_e4m3", torch.float32, head_dim=64)
    assert rotated.hadamard and rotated.ident == "fp8_e4m3_hadamard" and rotated.dtype == torch.float8_e4m3fn
    assert not KVFormat.resolve("fp8_e4m3", torch.float32, head_dim=96).hadamard       # not a power of two
    assert not KVFormat.resolve("fp8_e4m3", torch.float32, latent=True, head_dim=64).hadamard   # MLA latent rows
    assert not KVFormat.resolve("fp32", torch.float32, head_dim=64).hadamard
    assert rotated.bytes_per_token(30, 3, 64) == KVFormat("fp8_e4m3").bytes_per_token(30, 3, 64)
    int8 = KVFormat.resolve("int8", torch.float32, head_dim=64)
    assert int8.hadamard and int8.ident == "int8_hadamard" and int8.dtype == torch.int8
    assert KVFormat.resolve("int8", torch.float32, latent=True, head_dim=576).ident == "mla_int8"
    assert len({rotated.ident, int8.ident, KVFormat.resolve("int8", torch.float32, latent=True).ident}) == 3
