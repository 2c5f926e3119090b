"""backend/quant/kv_gate.py: the KV format a node serves, chosen per model by measured KL divergence against fp32 KV.
The measurement runs through the engine's real paged pool on a tiny random Llama (transformers' classes, real
safetensors); the tokenizer is a byte-level stand-in (the gate only needs ids of a text)."""

from __future__ import annotations

import math

import pytest
import torch

from edgeinfer.backend.engine.loading import model_fingerprint
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.quant import kv_gate
from edgeinfer.backend.quant.kv_gate import FormatCost, cost_against, decide, pick
from tests.support.tiny import tiny_llama


class ByteTokens:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def cost(name: str, bpt: int, kld: float) -> FormatCost:
    return FormatCost(name, bpt, kld, kld * 5, 0.99, 1.0)


def test_pick_is_the_most_compact_format_within_the_budget():
    costs = {"int8": cost("int8_hadamard", 100, 0.0006), "fp8_e4m3": cost("fp8_e4m3_hadamard", 100, 0.004),
             "bf16": cost("bf16", 200, 0.0002)}
    assert pick(costs, 0.002) == "int8"
    assert pick(costs, 0.005) == "int8"          # same bytes as fp8: the lower KLD
    assert pick(costs, 0.0005) == "bf16"         # int8 over budget: the next most compact
    assert pick(costs, 0.0001) == "fp32"         # nothing within: exact KV
    assert pick({**costs, "fp8_e4m3": cost("fp8", 100, 0.0001)}, 0.002) == "fp8_e4m3"


def test_the_cost_is_kl_divergence_top1_and_perplexity_of_the_same_positions():
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(40, 30, generator=g) * 3, -1)
    ids = torch.randint(0, 30, (40,), generator=g).tolist()
    same = cost_against(ref, ref, ids, "x", 1)
    assert (same.kld_mean, same.same_top1, same.ppl_ratio) == (0.0, 1.0, 1.0)
    got = torch.log_softmax(ref + torch.randn(40, 30, generator=g) * 0.3, -1)
    c = cost_against(ref, got, ids, "x", 1)
    want = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="none").sum(-1)   # KL(ref || got)
    assert math.isclose(c.kld_mean, float(want.mean()), rel_tol=1e-5) and c.kld_p99 >= c.kld_mean > 0
    assert c.same_top1 == float((ref.argmax(-1) == got.argmax(-1)).float().mean()) < 1.0
    nxt = torch.tensor(ids[1:])
    ratio = math.exp(float(ref[:-1].gather(1, nxt[:, None]).mean() - got[:-1].gather(1, nxt[:, None]).mean()))
    assert math.isclose(c.ppl_ratio, ratio, rel_tol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_llama(tmp_path_factory.mktemp("gate") / "m", max_position=256)   # a 256-token window
    return path, load_model(path)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))    # the machine-wide copy, isolated too
    return tmp_path / "home"


def test_auto_measures_every_candidate_caches_them_and_applies_the_budget_afresh(tiny, home, monkeypatch):
    path, model = tiny
    (path / "kv_gate.json").unlink(missing_ok=True)
    fp = model_fingerprint(path)
    d = decide(model, ByteTokens(), path, fp, "auto", 1e9)
    assert set(d.measured) == {"int8", "fp8_e4m3", "bf16"} and d.seconds > 0
    m = d.measured
    assert m["int8"].ident == "int8_hadamard" and m["fp8_e4m3"].ident == "fp8_e4m3_hadamard"
    assert m["int8"].bytes_per_token == m["fp8_e4m3"].bytes_per_token < m["bf16"].bytes_per_token
    assert all(c.kld_mean > 0 for c in m.values())
    # the finer grids are the closer ones (bf16: 8 mantissa bits; int8 at a per-head scale beats e4m3's 3 bits)
    assert m["bf16"].kld_mean < m["int8"].kld_mean < m["fp8_e4m3"].kld_mean
    assert d.served == pick(m, 1e9) == "int8"
    assert (path / "kv_gate.json").is_file() and (home / "kv_gate" / f"{fp}.json").is_file()
    assert (home.parent / "xdg" / "edgeinfer" / "kv_gate" / f"{fp}.json").is_file()

    def no_measuring(*a, **k):
        raise AssertionError("measured again: the cache was not used")

    monkeypatch.setattr(kv_gate, "measure", no_measuring)
    tight = decide(model, ByteTokens(), path, fp, "auto", m["bf16"].kld_mean * 1.01)
    assert tight.served == "bf16" and tight.seconds == 0 and tight.measured == m
    assert decide(model, ByteTokens(), path, fp, "auto", m["bf16"].kld_mean / 2).served == "fp32"
    (path / "kv_gate.json").unlink()          # a read-only or fresh model dir: the user's cache still has it
    assert decide(model, ByteTokens(), path, fp, "auto", 1e9).measured == m
    (home / "kv_gate" / f"{fp}.json").unlink()   # another EDGEINFER_HOME: the machine-wide cache has it
    assert not (path / "kv_gate.json").exists()
    assert decide(model, ByteTokens(), path, fp, "auto", 1e9).measured == m


def test_a_forced_format_is_served_as_forced_with_its_cost_measured(tiny, home):
    path, model = tiny
    (path / "kv_gate.json").unlink(missing_ok=True)
    d = decide(model, ByteTokens(), path, "forced-fp", "fp8_e4m3", 1e-12)
    assert d.served == "fp8_e4m3" and set(d.measured) == {"fp8_e4m3"} and d.measured["fp8_e4m3"].kld_mean > 1e-12
    report = d.report()
    assert report["requested"] == "fp8_e4m3" and report["measured"]["fp8_e4m3"]["ident"] == "fp8_e4m3_hadamard"
    zero = decide(model, ByteTokens(), path, "forced-fp", "auto", 0.0)
    assert (zero.served, zero.measured) == ("fp32", {})         # a budget of 0: no loss allowed, nothing measured
    assert decide(model, ByteTokens(), path, "forced-fp", "bf16", 0.0).served == "bf16"


@pytest.mark.parametrize("budget", [-0.1, float("nan"), float("inf")])
def test_a_bad_budget_is_refused_naming_it(tiny, home, budget):
    path, model = tiny
    with pytest.raises(ValueError, match="kv_kld_budget=.* is invalid: expected a finite number >= 0"):
        decide(model, ByteTokens(), path, "fp", "auto", budget)
    with pytest.raises(ValueError, match="kv_dtype='int4' is invalid"):
        decide(model, ByteTokens(), path, "fp", "int4", 0.002)


def test_a_model_dir_that_cannot_be_written_falls_back_to_the_user_cache(tiny, home):
    path, model = tiny
    (path / "kv_gate.json").unlink(missing_ok=True)
    (path / "kv_gate.json").mkdir()          # neither readable nor writable as a file (even for root)
    try:
        d = decide(model, ByteTokens(), path, "ro-fp", "auto", 0.002)
    finally:
        (path / "kv_gate.json").rmdir()
    assert (home / "kv_gate" / "ro-fp.json").is_file() and set(d.measured) == set(kv_gate.CANDIDATES)
