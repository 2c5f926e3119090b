"""GGUF import of a GLM-4.5 MoE (llama.cpp's glm4moe layout: [E, N, K] expert tensors, exp_probs_b, shared experts)
and of a DeepSeek-V3 (deepseek2: MLA tensors, kv_b_proj split into k_b and v_b): dequantized it is transformers'
model, native it keeps the Q4_0 linears and experts 4-bit and computes what the dequantized import does. (The
layouts were also checked on llama.cpp's own convert_hf_to_gguf.py + llama-quantize output: benchmarks/moe.py,
and a DeepSeek-V3 with YaRN by hand, recorded in issue 29's note.)"""

from __future__ import annotations

import json

import pytest
import torch

from edgeinfer.backend.model.gguf_import import ModelImportError, default_gguf_path, import_gguf
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.model.moe import Int4Experts
from tests.support import moe_checkpoints
from tests.support.dense import greedy

PROMPT = list(range(200, 240))


@pytest.fixture(scope="module")
def glm(smol_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("glm")
    hf = moe_checkpoints.servable("glm4_moe", d, smol_dir)
    return hf, tmp_path_factory.mktemp("gguf")


def test_f32_gguf_imports_to_transformers_model(glm):
    hf, tmp = glm
    src = moe_checkpoints.write_moe_gguf(hf, tmp / "f32.gguf", default_gguf_path(), quant="F32")
    dst = import_gguf(src, tmp / "f32", progress=False)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["partial_rotary_factor"] == 0.5
    assert cfg["use_qk_norm"] and cfg["attention_bias"] and cfg["n_routed_experts"] == 16
    logits, out = greedy(load_model(dst), PROMPT, 16, num_pages=8)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[0, len(PROMPT):].tolist()
    assert (ref - logits).abs().max().item() <= 1e-4 and out == theirs


def test_q4_0_gguf_native_keeps_experts_int4_and_equals_the_dequantized_import(glm):
    hf, tmp = glm
    src = moe_checkpoints.write_moe_gguf(hf, tmp / "q4_0.gguf", default_gguf_path(), quant="Q4_0")
    native = import_gguf(src, tmp / "native", native=True, progress=False)
    dense = import_gguf(src, tmp / "dense", progress=False)
    qc = json.loads((native / "config.json").read_text())["quantization_config"]
    assert qc["offset"] == "min" and qc["gguf_types"] == ["Q4_0"]
    plain = load_model(native, prepack=False)
    experts = plain.layers[1].mlp.experts
    assert isinstance(experts, Int4Experts) and experts.gu_m is not None
    want, want_out = greedy(load_model(dense), PROMPT, 16, num_pages=8)
    got, got_out = greedy(plain, PROMPT, 16, num_pages=8)
    assert (got - want).abs().max().item() <= 1e-4 and got_out == want_out
    packed = load_model(native)
    assert packed.layers[1].mlp.experts.prepacked
    fast, _ = greedy(packed, PROMPT, 4, num_pages=8)
    assert float((fast - want).norm() / want.norm()) < 0.03    # int8 activations in the grouped kernel


def test_unknown_architecture_is_named(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelImportError, match="unsupported GGUF architecture 'mamba'; supported: 'llama', 'glm4moe'"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)


@pytest.mark.parametrize("quant", ["F32", "Q4_0"])
def test_deepseek2_gguf_imports_to_transformers_model_and_native_equals_dequantized(smol_dir, tmp_path, quant):
    hf = moe_checkpoints.servable("deepseek_v3", tmp_path / "hf", smol_dir)
    src = moe_checkpoints.write_moe_gguf(hf, tmp_path / "m.gguf", default_gguf_path(), quant=quant)
    dense = import_gguf(src, tmp_path / "dense", progress=False)
    cfg = json.loads((dense / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["kv_lora_rank"] == 32 and cfg["q_lora_rank"] == 48
    logits, out = greedy(load_model(dense), PROMPT, 16, num_pages=8)
    if quant == "F32":
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPT])).logits[0]
            theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0, len(PROMPT):].tolist()
        assert (ref - logits).abs().max().item() <= 1e-4 and out == theirs
        return
    native = load_model(import_gguf(src, tmp_path / "native", native=True, progress=False), prepack=False)
    assert isinstance(native.layers[1].mlp.experts, Int4Experts)
    assert type(native.layers[1].self_attn.kv_a_proj).__name__ == "W4A16Linear"     # Q4_0 MLA linears stay 4-bit
    got, got_out = greedy(native, PROMPT, 16, num_pages=8)
    assert (got - logits).abs().max().item() <= 1e-4 and got_out == out


def test_a_q4_0_gguf_k_b_and_v_b_run_as_per_head_int4_maps(smol_dir, tmp_path):
    """A deepseek2 GGUF whose k_b and v_b are Q4_0 (as llama-quantize leaves them): on the CPU path the absorbed
    decode reads them as per-head INT4 maps (one grouped GEMM each) holding exactly the dequantized values, and
    decodes what the fp32 maps decode; an fp32 checkpoint keeps its fp32 maps."""
    from edgeinfer.backend.model.mla import q4_0_exact_x8
    from edgeinfer.kernels import cpu as cpu_kernels

    hf = moe_checkpoints.servable("deepseek_v3", tmp_path / "hf", smol_dir, qk_nope_head_dim=32, v_head_dim=32)
    src = moe_checkpoints.write_moe_gguf(hf, tmp_path / "m.gguf", default_gguf_path(), quant="Q4_0")
    native = import_gguf(src, tmp_path / "native", native=True, progress=False)
    plain, packed = load_model(native, prepack=False), load_model(native)
    for layer in packed.layers:
        attn = layer.self_attn
        assert attn.uk_x8 is not None and attn.uv_x8 is not None
        for x8, w in ((attn.uk_x8, attn.w_uk.transpose(1, 2)), (attn.uv_x8, attn.w_uv)):
            for h in range(w.shape[0]):
                blocks = cpu_kernels.unpack_q4_1x8(x8[h], w.shape[1])
                out = torch.empty(w.shape[1], w.shape[2])
                assert torch.equal(cpu_kernels.q4_1_dequant(blocks, out), w[h])      # the same values exactly
    want_logits, want = greedy(plain, PROMPT, 16, num_pages=8)
    got_logits, got = greedy(packed, PROMPT, 16, num_pages=8)
    assert got == want
    assert (got_logits - want_logits).abs().max().item() <= 0.05 * want_logits.abs().max().item()
    assert q4_0_exact_x8(torch.randn(2, 8, 64)) is None                    # fp32 values: the maps stay fp32
    assert load_model(tmp_path / "hf").layers[0].self_attn.uk_x8 is None   # the fp32 checkpoint
