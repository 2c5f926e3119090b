"""Quantized checkpoints: quantize a tiny random Llama (RTN and AWQ), load, serve through the engine;
community layouts load to the same model; malformed quantization_config fails naming file and field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.loading import load_engine
from edgeinfer.backend.model.linear import W4A16Linear
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.model.model_config import CheckpointError
from edgeinfer.backend.model.packing import group_dequantize_tensor, to_autoawq_gemm, to_gptq
from edgeinfer.backend.quant.calib import paged_prefill
from edgeinfer.backend.quant.quantize import quantize_checkpoint
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

VOCAB = 512


def _tiny_llama(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    g = torch.Generator().manual_seed(0)
    h, inter, layers, heads, kv_heads, hd = 192, 256, 2, 6, 2, 32   # 192: g128 falls back to 96
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": hd, "vocab_size": VOCAB, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": True, "eos_token_id": 1, "hidden_act": "silu"}

    def rnd(*s, scale=0.05):
        return torch.randn(*s, generator=g) * scale
    t = {"model.embed_tokens.weight": rnd(VOCAB, h, scale=1.0), "model.norm.weight": 1 + rnd(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, shape in {"self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv_heads * hd, h),
                         "self_attn.v_proj": (kv_heads * hd, h), "self_attn.o_proj": (h, heads * hd),
                         "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}.items():
            t[p + n + ".weight"] = rnd(*shape)
        t[p + "input_layernorm.weight"] = 1 + rnd(h)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(h)
    path.mkdir(parents=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("tiny") / "fp32")


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for method in ("rtn", "awq"):
        out[method] = quantize_checkpoint(tiny, tmp_path_factory.mktemp(method) / "q", "w4a16-g128", method,
                                          calib_chunks=2, calib_len=64, progress=False)
    return out


IDS = [[(7 * i + 3) % VOCAB for i in range(40)], [(11 * i + 5) % VOCAB for i in range(23)]]


def _logits(model, chunks=IDS):
    return model.compute_logits(paged_prefill(model, chunks))


def _dequantized_reference(qdir: Path) -> torch.Tensor:
    """Logits of a dense model whose linears are group_dequantize_tensor of the checkpoint (the oracle)."""
    model = load_model(qdir, prepack=False)
    for m in list(model.modules()):
        for name, child in list(m.named_children()):
            if isinstance(child, W4A16Linear):
                from edgeinfer.backend.model.linear import DenseLinear
                w = group_dequantize_tensor(child.qweight, child.scales, child.zeros, child.group_size)
                setattr(m, name, DenseLinear(w, child.bias))
    return _logits(model)


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_quantized_checkpoint_loads_and_matches_oracle(tiny, quantized, method):
    qdir = quantized[method]
    qc = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "edgeinfer-w4a16" and qc["group_size"] == 128 and qc["method"] == method
    model = load_model(qdir, prepack=False)      # the reference path: dequantize, fp32 GEMM
    linears = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    assert len(linears) == 2 * 4
    assert {m.group_size for m in linears} == {96, 128}            # K=192 -> 96, down K=256 -> 128
    dense = load_model(tiny)
    assert model.linear_weight_bytes() <= 0.16 * dense.linear_weight_bytes()   # vs fp32: 4 bits + fp16 s/z
    got, ref, fp = _logits(model), _dequantized_reference(qdir), _logits(dense)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == fp.argmax(-1)).float().mean() > 0.6   # random weights: loose agreement


def test_awq_folds_scales_exactly_before_rounding(tiny, quantized):
    # AWQ only edits RMSNorm weights and scales linears; norms differ from the source checkpoint
    src, q = load_file(str(tiny / "model.safetensors")), load_file(str(quantized["awq"] / "model.safetensors"))
    assert not torch.equal(src["model.layers.0.input_layernorm.weight"], q["model.layers.0.input_layernorm.weight"])
    assert torch.equal(src["model.embed_tokens.weight"], q["model.embed_tokens.weight"])


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_quantized_checkpoint_serves_through_engine(quantized, kv_dtype):
    eng = load_engine(quantized["awq"], EngineConfig(num_pages=32, kv_dtype=kv_dtype, max_num_batched_tokens=64))
    eng.start()
    try:
        async def one(i, ids):
            toks = []
            req = GenerateRequest(f"q{i}", ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "ns")
            async for c in eng.generate(req):
                toks += c.token_ids
            return toks

        async def main():
            return await asyncio.gather(*[one(i, ids) for i, ids in enumerate(IDS)])
        outs = asyncio.run(main())
    finally:
        eng.stop()
    assert [len(o) for o in outs] == [6, 6]
    assert eng.runner.bytes_per_token == 2 * 2 * 2 * (32 * (1 if kv_dtype == "fp8_e4m3" else 4)
                                                       + (2 if kv_dtype == "fp8_e4m3" else 0))   # bf16 scale


def _rewrite(qdir: Path, dst: Path, fmt: str) -> Path:
    dst.mkdir()
    t = load_file(str(qdir / "model.safetensors"))
    raw = json.loads((qdir / "config.json").read_text())
    out = {k: v for k, v in t.items() if not k.endswith((".qweight", ".scales", ".zeros"))}
    for k in [k[: -len(".qweight")] for k in t if k.endswith(".qweight")]:
        q, s, z = t[k + ".qweight"], t[k + ".scales"], t[k + ".zeros"]
        if fmt == "awq":
            out[k + ".qweight"], out[k + ".qzeros"], out[k + ".scales"] = to_autoawq_gemm(q, s, z)
        else:
            g = q.shape[1] * 2 // s.shape[1]
            out[k + ".qweight"], out[k + ".qzeros"], out[k + ".scales"], out[k + ".g_idx"] = to_gptq(q, s, z, g)
    raw["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                   "version": "gemm"} if fmt == "awq" else
                                  {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                   "sym": False, "checkpoint_format": "gptq"})
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_community_layout_loads_to_same_model(quantized, tmp_path, fmt):
    qdir = quantized["rtn"]
    t = load_file(str(qdir / "model.safetensors"))
    if fmt == "gptq" and any((v == 0).any() for k, v in t.items() if k.endswith(".zeros")):
        pytest.skip("GPTQ v1 cannot store a zero point of 0")
    other = load_model(_rewrite(qdir, tmp_path / fmt, fmt))
    torch.testing.assert_close(_logits(other), _logits(load_model(qdir)), atol=0, rtol=0)


@pytest.mark.parametrize("edit,field", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"group_size": 100}, "group_size"),
    ({"group_size": None}, "group_size"),
    ({"bits": 8}, "bits"),
    ({"packing": "int32"}, "packing"),
    ({"zero_point": "yes"}, "zero_point"),
])
def test_malformed_quantization_config_names_file_and_field(quantized, tmp_path, edit, field):
    dst = tmp_path / "bad"
    dst.mkdir()
    raw = json.loads((quantized["rtn"] / "config.json").read_text())
    raw["quantization_config"].update(edit)
    (dst / "config.json").write_text(json.dumps(raw))
    (dst / "model.safetensors").symlink_to(quantized["rtn"] / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{dst}/config.json: quantization_config\.{field}="):
        load_model(dst)


def test_missing_quantized_tensor_is_named(quantized, tmp_path):
    dst = tmp_path / "missing"
    dst.mkdir()
    t = load_file(str(quantized["rtn"] / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.scales"]
    save_file(t, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((quantized["rtn"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.scales"):
        load_model(dst)


def test_quantize_cli_errors(tiny, quantized, tmp_path):
    from types import SimpleNamespace

    from edgeinfer.backend.quant.quantize import main
    assert main(SimpleNamespace(src=str(tiny), dst=str(tmp_path / "x"), scheme="w3a16", method="rtn")) == 2
    assert main(SimpleNamespace(src=str(quantized["rtn"]), dst=str(tmp_path / "y"), scheme="w4a16-g128",
                                method="rtn")) == 2


@pytest.mark.parametrize("method", ["rtn", "awq-gptq"])
def test_g64_scheme_round_trip_and_load(tiny, tmp_path, method):
    # w4a16-g64: every K here (192, 256) is a multiple of 64, so no fallback; the loader recomputes it
    qdir = quantize_checkpoint(tiny, tmp_path / "q64", "w4a16-g64", method, calib_chunks=2, calib_len=64,
                               progress=False)
    qc = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 64 and qc["scheme"] == "w4a16-g64" and qc["method"] == method
    if method != "rtn":
        assert qc["calibration"]["sequences"] == 2 and qc["calibration"]["source"]
    raw = load_file(str(qdir / "model.safetensors"))
    assert raw["model.layers.0.mlp.down_proj.scales"].shape == (192, 256 // 64)
    model = load_model(qdir, prepack=False)
    linears = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    assert {m.group_size for m in linears} == {64}
    torch.testing.assert_close(_logits(model), _dequantized_reference(qdir), atol=1e-4, rtol=1e-4)
    agree = (_logits(model).argmax(-1) == _logits(load_model(tiny)).argmax(-1)).float().mean()
    assert agree > 0.6


def test_calibration_sources_and_interleaving(tiny, tmp_path):
    from edgeinfer.backend.quant.calib import calibration_sources, interleaved_chunks
    from edgeinfer.backend.quant.quantize import QuantizeError, calibration_chunks

    names = [n for _, n in calibration_sources("mix")]
    assert names and all(n != "CPython idlelib/NEWS.txt" and "NEWS" not in n for n in names)   # eval text is disjoint
    assert [n for _, n in calibration_sources("tqdm")][0].startswith("tqdm-")
    got = interleaved_chunks([list(range(10)), list(range(100, 104)), [7]], num=4, length=2)
    assert got == [[0, 1], [100, 101], [2, 3], [102, 103]]
    assert len(calibration_chunks(tiny, 3, 16)[0]) == 3
    with pytest.raises(QuantizeError, match="unknown calibration"):
        quantize_checkpoint(tiny, tmp_path / "bad", "w4a16-g64", "awq", calibration="nope", progress=False)


@pytest.mark.parametrize("method", ["rtn", "awq-gptq"])
def test_cpu_int4_prepacked_path_matches_the_oracle(tiny, tmp_path, method):
    """load_model on CPU repacks g64 INT4 linears for torch's int4 GEMM: still 4-bit, bf16 activations."""
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch has no CPU int4 GEMM")
    qdir = quantize_checkpoint(tiny, tmp_path / "q64", "w4a16-g64", method, calib_chunks=2, calib_len=64,
                               progress=False)
    plain, packed = load_model(qdir, prepack=False), load_model(qdir)
    linears = [m for m in packed.modules() if isinstance(m, W4A16Linear)]
    assert linears and all(m.int4pack is not None and m.qweight is None for m in linears)
    assert all(m.int4pack.dtype == torch.uint8 and m.int4pack.numel() * 2 == m._shape[0] * m._shape[1]
               for m in linears)                                    # 4 bits a weight, the originals freed
    assert packed.linear_weight_bytes() == plain.linear_weight_bytes()
    assert packed.weight_bytes() == plain.weight_bytes()               # the packed linears are counted
    got, ref = _logits(packed), _dequantized_reference(qdir)
    # bf16 in, bf16 out (8-bit mantissa: 2^-8 relative per GEMM) and bf16-rounded scales, through 2 layers
    # of 4 GEMMs each: within 0.5% of the largest logit (measured: 0.1%)
    scale = float(ref.abs().max())
    torch.testing.assert_close(got, ref, atol=0.005 * scale, rtol=0)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.9


def test_int4_group_96_runs_as_groups_of_32_on_the_cpu_gemm(quantized):
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch has no CPU int4 GEMM")
    qdir = quantized["rtn"]                                        # g128 -> 96 on K=192, 128 on K=256
    model = load_model(qdir)
    linears = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    assert {(m.group_size, m._op_group) for m in linears} == {(96, 32), (128, 128)}
    assert all(m.int4pack is not None for m in linears)
    got, ref = _logits(model), _dequantized_reference(qdir)
    torch.testing.assert_close(got, ref, atol=0.005 * float(ref.abs().max()), rtol=0)
