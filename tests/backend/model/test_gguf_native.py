"""GGUF quantized weights served natively: Q4_0/Q4_1/Q8_0 blocks decode to exactly gguf's own dequantization;
the native INT4 model matches the dequantize-then-dense oracle; the import CLI keeps both forms; bad input
fails naming the type; `edgeinfer backend` serves the native import by default."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from edgeinfer.backend.model import gguf_blocks
from edgeinfer.backend.model.gguf_import import (
    ModelImportError,
    default_gguf_path,
    import_gguf,
    native_default_dir,
)
from edgeinfer.backend.model.linear import Q8Embedding, W4A16Linear
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.model.model_config import CheckpointError
from edgeinfer.backend.model.packing import group_dequantize_mins, group_dequantize_tensor
from edgeinfer.backend.model.quant_format import QuantConfig
from edgeinfer.backend.quant.calib import paged_prefill

Q = gguf.GGMLQuantizationType


def _ours_dequantized(kind: str, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    if kind == "Q4_1":
        q, s, m = gguf_blocks.q4_1(data, n, k)
        return group_dequantize_mins(q, s, m, 32)
    if kind == "Q4_0":
        q, s = gguf_blocks.q4_0(data, n, k)
        return group_dequantize_tensor(q, s, None, 32)
    q8, s = gguf_blocks.q8_0(data, n, k)
    return gguf_blocks.dequantize_int8(q8, s)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(3, 32), (5, 96), (64, 576)])
def test_synthetic_blocks_decode_to_gguf_dequantize_exactly(kind, n, k):
    g = np.random.default_rng(n * k)
    w = (g.standard_normal((n, k)) * g.uniform(0.01, 3.0, (n, 1))).astype(np.float32)
    w[0, :32] = 0.0                                  # an all-zero block (d = 0)
    w[-1, -32:] = np.abs(w[-1, -32:]) + 0.5          # all-positive block: Q4_1's min > 0
    data = gguf.quants.quantize(w, Q[kind])
    want = gguf.quants.dequantize(data, Q[kind]).reshape(n, k)
    got = _ours_dequantized(kind, data, n, k)
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(want))


def test_q4_0_as_mins_is_exact():
    # a Q4_0 tensor among Q4_1 ones is stored with mins = -8 d: still gguf's values bit for bit
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    data = gguf.quants.quantize(w, Q.Q4_0)
    q, s = gguf_blocks.q4_0(data, 8, 64)
    got = group_dequantize_mins(q, s, -8 * s, 32)
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(data, Q.Q4_0).reshape(8, 64)))


def test_block_decoding_rejects_wrong_sizes():
    with pytest.raises(gguf_blocks.BlockError, match="Q4_1: 100 bytes for a \\[2, 64\\] tensor, expected 80"):
        gguf_blocks.q4_1(np.zeros(100, np.uint8), 2, 64)
    with pytest.raises(gguf_blocks.BlockError, match="row length 40 is not a multiple of the block size 32"):
        gguf_blocks.q8_0(np.zeros(68, np.uint8), 1, 40)


@pytest.fixture(scope="module")
def real_reader():
    return gguf.GGUFReader(str(default_gguf_path()))


def test_real_file_tensors_decode_to_gguf_dequantize_exactly(real_reader):
    kinds = {t.tensor_type.name for t in real_reader.tensors}
    assert {"Q4_1", "Q8_0"} <= kinds
    checked = 0
    for t in real_reader.tensors:
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else None
        if t.tensor_type.name not in gguf_blocks.NATIVE_TYPES or layer not in (None, "0", "17", "29"):
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k))
        assert torch.equal(_ours_dequantized(t.tensor_type.name, t.data, n, k), want), t.name
        checked += 1
    assert checked == 1 + 3 * 7   # token_embd (Q8_0) + 7 linears in each of 3 layers (Q4_1)


def test_offset_min_in_quantization_config():
    base = {"quant_method": "edgeinfer-w4a16", "bits": 4, "group_size": 32, "zero_point": True,
            "packing": "uint8-k2-lo-even"}
    assert QuantConfig.from_dict({**base, "offset": "min"}, "x").offset == "min"
    assert QuantConfig.from_dict(base, "x").offset == "zero"
    with pytest.raises(CheckpointError, match="offset='max' is unsupported"):
        QuantConfig.from_dict({**base, "offset": "max"}, "x")
    with pytest.raises(CheckpointError, match="offset='min' needs zero_point true"):
        QuantConfig.from_dict({**base, "zero_point": False, "offset": "min"}, "x")


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_native_import_of_unsupported_quant_type_names_it(tmp_path):
    src = _write_gguf(tmp_path / "k.gguf", {"blk.0.attn_q.weight": (np.zeros((2, 210), np.uint8), Q.Q6_K)})
    with pytest.raises(ModelImportError, match=r"'blk.0.attn_q.weight' is Q6_K; a native INT4 import takes "
                                               r"Q4_0 or Q4_1 linears \(re-run with --dequantize"):
        import_gguf(src, tmp_path / "out", native=True, progress=False)
    assert not (tmp_path / "out").exists()
    r = subprocess.run([sys.executable, "-m", "edgeinfer.ops.cli", "model", "import", str(src), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "is Q6_K" in r.stderr and str(src) in r.stderr


@pytest.fixture(scope="session")
def native_dir():
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model

    return ensure_native_default_model()


@pytest.mark.slow
def test_native_import_keeps_the_gguf_bytes(native_dir):
    cfg = json.loads((native_dir / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "edgeinfer-w4a16" and cfg["offset"] == "min" and cfg["group_size"] == 32
    t = load_file(str(native_dir / "model.safetensors"))
    assert t["model.layers.0.mlp.down_proj.qweight"].dtype == torch.uint8
    assert t["model.layers.0.mlp.down_proj.qweight"].shape == (576, 768)
    assert t["model.embed_tokens.qweight"].dtype == torch.int8 and "model.embed_tokens.weight" not in t
    on_disk = sum(v.numel() * v.element_size() for v in t.values())
    assert on_disk < 1.05 * default_gguf_path().stat().st_size   # 96.6 MB vs the GGUF's 98.4 MB


@pytest.fixture(scope="module")
def oracle_and_prompt(smol_dir, smol_tokenizer):
    # the oracle: the dequantized import (gguf.quants.dequantize of the same file) through dense fp32 linears
    ids = smol_tokenizer.encode_chat([{"role": "user", "content": "Name three colors of the rainbow."}])
    oracle = load_model(smol_dir, prepack=False)
    return oracle, ids, oracle.compute_logits(paged_prefill(oracle, [ids], "fp32", 16))


@pytest.mark.slow
def test_native_reference_path_equals_dequantized_oracle(native_dir, oracle_and_prompt):
    oracle, ids, want = oracle_and_prompt
    native = load_model(native_dir, prepack=False)
    # the weights are gguf's values bit for bit ...
    for lo, ln in zip(oracle.layers, native.layers):
        down = ln.mlp.down_proj
        assert isinstance(down, W4A16Linear) and down.mins is not None
        assert torch.equal(group_dequantize_mins(down.qweight, down.scales, down.mins, 32), lo.mlp.down_proj.weight)
    assert isinstance(native.embed_tokens, Q8Embedding)
    assert torch.equal(native.embed_tokens.dequantize(), oracle.embed_tokens.data)
    # ... so the logits differ by fp32 summation order at most (fused vs split GEMMs): 1e-4 on logits of ~30
    got = native.compute_logits(paged_prefill(native, [ids], "fp32", 16))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_served_native_path_matches_oracle_within_bf16_rounding(native_dir, oracle_and_prompt, monkeypatch):
    oracle, ids, want = oracle_and_prompt
    monkeypatch.setenv("EDGEINFER_CPU_KERNELS", "torch")   # the fallback path (kernels.cpu: test_cpu_q4_kernels)
    served = load_model(native_dir)   # prepacked for torch's CPU int4 GEMM
    linears = [m for m in served.modules() if isinstance(m, W4A16Linear)]
    assert len(linears) == 4 * 30 and all(m.prepacked and m.qweight is None for m in linears)
    assert served.weight_bytes() < 0.4 * oracle.weight_bytes() and served.prepacked_copy_bytes() == 0
    got = served.compute_logits(paged_prefill(served, [ids], "fp32", 16))
    # The int4 GEMM rounds activations and the per-group scale/offset to bf16 (8-bit mantissa, 2^-9 relative)
    # in every one of 120 linears; the error measured here is ~1.3% of the logit range. Tolerance 4%, and the
    # greedy token equal wherever the oracle's top-2 margin exceeds it.
    tol = 0.04 * float(want.abs().max())
    err = float((got - want).abs().max())
    assert err < tol, (err, tol)
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert clear.sum() >= 1 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.slow
def test_import_cli_default_is_native_and_dequantize_flag_keeps_dense(tmp_path, smol_dir):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgeinfer.ops.cli", "model", "import", *args], capture_output=True,
                              text=True, timeout=600)

    src = str(default_gguf_path())
    r = cli(src, str(tmp_path / "dense"), "--dequantize")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert "quantization_config" not in cfg
    dense = load_file(str(tmp_path / "dense" / "model.safetensors"))
    ref = load_file(str(smol_dir / "model.safetensors"))
    assert dense.keys() == ref.keys() and all(v.dtype == torch.float32 for v in dense.values())
    assert torch.equal(dense["model.layers.3.self_attn.k_proj.weight"], ref["model.layers.3.self_attn.k_proj.weight"])
    r = cli(src, str(tmp_path / "native"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "native" / "config.json").read_text())["quantization_config"]["offset"] == "min"
    native = load_file(str(tmp_path / "native" / "model.safetensors"))
    assert native["model.layers.3.self_attn.k_proj.qweight"].dtype == torch.uint8


@pytest.mark.slow
def test_backend_and_gateway_default_to_the_native_import(native_dir):
    from edgeinfer.backend.server import build_state, parse_args
    from edgeinfer.gateway.served_model import resolve_tokenizer_dir

    assert native_dir == native_default_dir() and resolve_tokenizer_dir("default") == native_dir
    st = build_state(parse_args(["--store-tier", "none", "--num-pages", "32", "--insecure-no-internal-auth"]))
    model = st.engine.model
    assert st.engine.model_name == "SmolLM2-135M-Instruct"
    assert isinstance(model.embed_tokens, Q8Embedding)
    assert all(m.prepacked for m in model.modules() if isinstance(m, W4A16Linear))
    assert model.weight_bytes() < 250e6   # vs 538 MB of fp32 weights (+113 MB prepacked head) before
