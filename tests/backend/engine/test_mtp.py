"""MTP drafts (backend/model/mtp.py, `speculative="mtp"`) on tiny GLM-4.5 and DeepSeek-V3 checkpoints that carry an
MTP layer as the published ones do (tests/support/moe_checkpoints.build_mtp: transformers' own decoder layer as its block).

transformers drops MTP layers, so there are two oracles:
- the MTP layer's logits at every step of a real engine run (chunked prefill, batched decodes, verify steps with
  accepted drafts) equal a from-scratch recomputation over the whole sequence with transformers' decoder layer
  (moe_checkpoints.mtp_reference_logits): the shift by one token, the main model's normed hidden state, the MTP
  layer's own KV over every earlier position;
- greedy output with MTP drafts is exactly the output without speculation (alone and batched, drafts accepted and
  rejected), and sampled output keeps the model's distribution (chi-square tests of the tokens a verify emits).
"""

from __future__ import annotations

import json

import pytest
import torch

from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.model.model_config import CheckpointError
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams
from tests.support import moe_checkpoints
from tests.support.engine_steps import Stepper, engine
from tests.support.tiny import prompt

KINDS = ("deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module", params=KINDS)
def ckpt(request, tmp_path_factory):
    """(kind, transformers model, MTP tensors, the MTP-loaded model, the plain model) with a random MTP layer."""
    d = tmp_path_factory.mktemp(request.param)
    hf, mtp = moe_checkpoints.build_mtp(request.param, d)
    return request.param, hf, mtp, load_model(d, mtp=True), load_model(d)


@pytest.fixture(scope="module", params=KINDS)
def echo(request, tmp_path_factory):
    """A checkpoint whose MTP layer often drafts what the model then emits (build_mtp's echo): both verify paths."""
    d = tmp_path_factory.mktemp(request.param + "-echo")
    hf, mtp = moe_checkpoints.build_mtp(request.param, d, echo=0.9)
    return request.param, hf, mtp, load_model(d, mtp=True), load_model(d)


def run(model, prompts: list[list[int]], max_tokens: int, record: list | None = None, **cfg):
    eng = engine(model, kv_dtype="fp32", num_pages=64, **cfg)
    if record is not None:
        assert eng.runner.mtp is not None
        step = eng.runner.mtp.step

        def recording(items):
            logits = step(items)
            record.append(([(list(s.all_ids), eng.runner.mtp.step_rows[id(s)][1], n) for s, n in items], logits))
            return logits

        eng.runner.mtp.step = recording  # type: ignore[method-assign]
    s = Stepper(eng)
    for i, p in enumerate(prompts):
        s.add(f"r{i}", p, max_tokens)
    s.run()
    assert eng.blocks.num_used == 0
    return [s.tokens[f"r{i}"] for i in range(len(prompts))], eng


def test_mtp_logits_at_every_step_equal_the_full_recomputation(ckpt):
    _check_against_the_reference(*ckpt[:4], accepted=False)


def test_mtp_logits_equal_the_recomputation_through_accepted_drafts(echo):
    _check_against_the_reference(*echo[:4], accepted=True)


def _check_against_the_reference(kind, hf, mtp, m, accepted: bool) -> None:
    record: list = []
    prompts = [prompt(s, 20 + 9 * s) for s in range(3)]
    _, eng = run(m, prompts, 20, record, speculative="mtp", spec_adaptive=False, max_num_batched_tokens=32)
    assert eng.speculation.stats.drafted > 0
    if accepted:
        assert eng.speculation.stats.accepted > 0          # verify steps whose accepted rows fed the MTP layer
    chunked = any(len(ids) > p0 + n + 1 for items, _ in record for ids, p0, n in items)
    assert chunked                            # a prefill chunk that was not the prompt's last (max_num_batched_tokens)
    checked = 0
    for items, logits in record:
        for (ids, p0, n), row in zip(items, logits):
            ref = moe_checkpoints.mtp_reference_logits(hf, mtp, ids[:p0 + n + 1])[-1]
            assert float((row - ref).abs().max()) <= 1e-4 * float(ref.abs().max()), (kind, p0, n)
            checked += 1
    assert checked >= 40


@pytest.mark.parametrize("n_seqs", [1, 3])
def test_greedy_output_with_mtp_drafts_is_exactly_the_plain_output(echo, n_seqs):
    kind, _, _, m, plain_model = echo
    prompts = [prompt(19 + s, 16) for s in range(n_seqs)]
    plain, _ = run(plain_model, prompts, 40, speculative="off")
    spec, eng = run(m, prompts, 40, speculative="mtp", spec_adaptive=False)
    assert spec == plain
    assert 0 < eng.speculation.stats.accepted < eng.speculation.stats.drafted, (kind, eng.speculation.stats.accepted, eng.speculation.stats.drafted)


def test_adaptive_mtp_drafting_keeps_greedy_output(ckpt):
    _, _, _, m, plain_model = ckpt
    prompts = [prompt(30 + s, 24) for s in range(4)]
    plain, _ = run(plain_model, prompts, 24, speculative="off")
    spec, eng = run(m, prompts, 24, speculative="mtp")
    assert spec == plain and eng.speculation.stats.drafted > 0      # the MTP prior (0.8) drafts from the first decode step


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> bool:
    from tests.backend.engine.test_speculative import _chi2_ok as chi2
    return chi2(counts, probs, draws)


def test_sampled_output_with_mtp_drafts_keeps_the_model_distribution(echo):
    """4,000 unseeded sampled requests (temperature 0.2) of 3 tokens from one prompt, MTP drafts on: the second and
    third tokens (emitted by verify steps: accepted drafts and residual samples) follow the model's own
    distributions given the tokens before them."""
    from edgeinfer.backend.engine.spec.verify import target_probs as _probs

    kind, _, _, m, _ = echo
    p = prompt(77, 20)
    sp = SamplingParams(max_tokens=3, temperature=0.2, ignore_eos=True)
    eng = engine(m, kv_dtype="fp32", num_pages=512, speculative="mtp", spec_adaptive=False, spec_max_batch=1024,
                 max_num_seqs=256, max_num_batched_tokens=2048)
    torch.manual_seed(0)
    outs: dict[str, list[int]] = {}
    n = 4000
    for i in range(n):
        toks: list[int] = []
        outs[f"s{i}"] = toks
        seq = eng._make_seq(GenerateRequest(f"s{i}", p, sp, "t"), lambda c, t=toks: t.extend(c.token_ids))
        eng._seqs[f"s{i}"] = seq
        eng.scheduler.add(seq)
    Stepper(eng).run()
    assert all(len(t) == 3 for t in outs.values())
    assert 0 < eng.speculation.stats.accepted < eng.speculation.stats.drafted, (eng.speculation.stats.accepted, eng.speculation.stats.drafted)

    class Seq:
        sampling, request_id = sp, "ref"

    def dist(prefix: list[int]) -> torch.Tensor:
        from tests.backend.engine.test_speculative import _all_logits
        return _probs(Seq, _all_logits(m, p + prefix)[-1])

    t1 = torch.tensor([t[0] for t in outs.values()]).mode().values.item()
    second = torch.zeros(m.cfg.vocab_size)
    for t in outs.values():
        if t[0] == t1:
            second[t[1]] += 1
    assert _chi2_ok(second, dist([t1]), int(second.sum()))
    pairs = [tuple(t[:2]) for t in outs.values()]
    t12 = max(set(pairs), key=pairs.count)
    third = torch.zeros(m.cfg.vocab_size)
    for t in outs.values():
        if tuple(t[:2]) == t12:
            third[t[2]] += 1
    assert int(third.sum()) >= 200, kind
    assert _chi2_ok(third, dist(list(t12)), int(third.sum()))


def test_mtp_needs_the_layer(ckpt, tmp_path):
    kind, hf, mtp, _, plain_model = ckpt
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        engine(plain_model, kv_dtype="fp32", num_pages=8, speculative="mtp")   # loaded without its MTP layer
    from tests.support.tiny import tiny_llama
    with pytest.raises(CheckpointError, match="no MTP layer"):
        load_model(tiny_llama(tmp_path / "llama"), mtp=True)
    d = tmp_path / "dropped"                                           # a converter that dropped the tensors
    hf.save_pretrained(d, safe_serialization=True)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    with pytest.raises(CheckpointError, match="MTP tensors are missing"):
        load_model(d, mtp=True)


def test_pages_written_from_outside_arrive_with_zeroed_mtp_rows(ckpt):
    _, _, _, m, _ = ckpt
    eng = engine(m, kv_dtype="fp32", num_pages=16, speculative="mtp")
    r = eng.runner
    assert r.mtp is not None and r.mtp.kv.k.shape[0] == r.num_pages
    r.mtp.kv.k[3].fill_(1.0)
    r.mtp.kv.k[5].fill_(1.0)
    r.mtp.clear([3])
    assert float(r.mtp.kv.k[3].abs().sum()) == 0 and float(r.mtp.kv.k[5].abs().min()) == 1.0


@pytest.mark.parametrize("quant", ["F32", "Q4_0"])
def test_a_glm4moe_gguf_with_its_nextn_layer_drafts_as_the_safetensors_checkpoint(tmp_path, quant):
    """llama.cpp's glm4moe conversion keeps the MTP layer as one more block (block_count = layers + 1, its own
    tensors `blk.3.nextn.*`): the import gives 3 decoder layers and the MTP layer (F32: the same MTP logits as the
    reference; Q4_0 native: its eh_proj and block stay 4-bit and greedy output still equals the plain output)."""
    from edgeinfer.backend.model.gguf_import import default_gguf_path, import_gguf
    from edgeinfer.backend.model.linear import W4A16Linear

    vocab = 49152          # the tokenizer GGUF's (SmolLM2's) vocabulary
    hf, mtp = moe_checkpoints.build_mtp("glm4_moe", tmp_path / "hf", vocab_size=vocab)
    src = moe_checkpoints.write_moe_gguf(hf, tmp_path / "m.gguf", default_gguf_path(), quant=quant, mtp=mtp)
    dst = import_gguf(src, tmp_path / "imported", native=quant != "F32", progress=False)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["num_nextn_predict_layers"] == 1
    m = load_model(dst, mtp=True, prepack=False)
    assert m.mtp is not None and len(m.layers) == 3
    if quant == "F32":
        _check_against_the_reference("glm4_moe", hf, mtp, m, accepted=False)
        return
    assert isinstance(m.mtp.eh_proj, W4A16Linear)
    prompts = [prompt(19 + s, 16) for s in range(2)]
    plain, _ = run(load_model(dst, prepack=False), prompts, 16, speculative="off")
    spec, eng = run(m, prompts, 16, speculative="mtp", spec_adaptive=False)
    assert spec == plain and eng.speculation.stats.drafted > 0
