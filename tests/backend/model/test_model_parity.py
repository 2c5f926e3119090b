"""The paged Llama-family model agrees with transformers (fp32) on SmolLM2 and on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch

from edgeinfer.backend.model.loader import load_model
from tests.support.dense import greedy

MEASURED: dict[str, float] = {}


def test_smollm2_logits_and_greedy_match_transformers(smol_model, hf_smol):
    ids = torch.randint(0, smol_model.cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    logits, ours = greedy(smol_model, ids, 32)
    with torch.no_grad():
        ref = hf_smol(torch.tensor([ids])).logits[0]
        theirs = hf_smol.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, 64:].tolist()
    diff = (ref - logits).abs().max().item()
    MEASURED["smollm2_max_abs_diff"] = diff
    print(f"SmolLM2 fp32 max-abs logit diff over 64 tokens: {diff:.3e}")
    assert diff <= 1e-3
    assert ours == theirs


def test_smollm2_answers_chat_prompt(smol_model, smol_tokenizer):
    ids = smol_tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    _, out = greedy(smol_model, ids, 12)
    assert "Paris" in smol_tokenizer.decode(out)


def _tiny(tmp_path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kind = overrides.pop("kind", "llama")
    shard = overrides.pop("max_shard_size", None)
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rope_theta=10000.0,
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    base.update(overrides)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**base)).eval()
    else:
        model = LlamaForCausalLM(LlamaConfig(**base)).eval()
    with torch.no_grad():   # random init gives near-uniform logits; sharpen so greedy is meaningful
        for p in model.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kw)
    return model


@pytest.mark.parametrize("case", [
    {"name": "gqa-4"},
    {"name": "mha", "num_key_value_heads": 8, "tie_word_embeddings": True},
    {"name": "llama3-rope", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"name": "linear-rope", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"name": "yarn-rope", "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 64}},
    {"name": "qwen2-bias", "kind": "qwen2"},
    {"name": "sharded", "max_shard_size": "100KB"},
], ids=lambda c: c["name"])
def test_tiny_random_model_matches_transformers(tmp_path, case):
    case = dict(case)
    case.pop("name")
    hf = _tiny(tmp_path, **case)
    if "max_shard_size" in case:
        assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_model(tmp_path)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    logits, out = greedy(ours, ids, 32, num_pages=8)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 40:]
    assert (ref - logits).abs().max().item() <= 1e-3
    assert out == theirs.tolist()


def test_tokenizer_and_chat_template_match_transformers(smol_dir, smol_tokenizer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smol_dir)
    for text in ["Hello world, it's 2026!", "  spaces\tand\nnewlines 12345", "héllo 世界 🙂", "<|im_start|>user"]:
        assert smol_tokenizer.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        assert smol_tokenizer.decode(smol_tokenizer.encode(text), skip_special_tokens=False) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    assert smol_tokenizer.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False,
                                                                              add_generation_prompt=True)


def test_measured_figures_are_recorded(tmp_path):
    # keeps the number from the parity test visible in the test log (-s) and in a file for the notes
    if "smollm2_max_abs_diff" in MEASURED:
        (tmp_path / "parity.json").write_text(json.dumps(MEASURED))
        assert MEASURED["smollm2_max_abs_diff"] >= 0
