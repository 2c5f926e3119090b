"""Issue 54, item 6: `echo` + `logprobs` on /v1/completions, the way lm-evaluation-harness and other evaluators score
a prompt's log-likelihood. Against `edgeinfer serve` as a user starts it (the default model: INT4 weights, fp8 KV),
through the openai client and through lm-evaluation-harness' `local-completions` model (its `remote` tokenizer
over /tokenize, /detokenize, /tokenizer_info), compared with transformers on the same weights (the GGUF's blocks
dequantized: tests/conftest.py's hf_smol)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import openai
import pytest
import torch

from tests.gateway.conftest import DEMO_KEY

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
FACTS = Path(__file__).resolve().parents[1] / "data" / "lmeval_facts.jsonl"
TEXTS = [   # two texts of different kinds
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small tin of oil and a cloth "
    "for the lamp. Ships passing the headland counted on its beam.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
]


@pytest.fixture(scope="module")
def base(compat_serve) -> str:
    return f"http://127.0.0.1:{compat_serve.port}"


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=DEMO_KEY, max_retries=0, timeout=300)


def _echo(base: str, prompt, max_tokens: int = 0, logprobs: int = 1, stream: bool = False):
    c = _client(base)
    if not stream:
        return c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=logprobs,
                                    temperature=0).choices[0]
    events = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True,
                                       logprobs=logprobs, temperature=0, stream=True))
    return events


@pytest.mark.parametrize("text", TEXTS, ids=["prose", "code"])
def test_echo_logprobs_are_the_prompts_own_and_match_transformers(base, hf_smol, smol_tokenizer, text):
    ids = smol_tokenizer.encode(text)
    choice = _echo(base, ids)                  # token ids: the ids scored are exactly these
    lp = choice.logprobs
    assert choice.text == smol_tokenizer.decode(ids, False) and choice.finish_reason == "length"
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens == [smol_tokenizer.decode([i], False) for i in ids]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    got = lp.token_logprobs[1:]
    diffs = [abs(a - b) for a, b in zip(got, want)]
    print(f"echo logprobs vs transformers ({len(want)} tokens, served default fp8 KV): mean abs diff "
          f"{sum(diffs) / len(diffs):.4f}, max {max(diffs):.4f}; sum {sum(got):.3f} vs {sum(want):.3f}")
    assert sum(diffs) / len(diffs) < 0.12 and max(diffs) < 1.0
    assert abs(sum(got) - sum(want)) < 0.05 * abs(sum(want)) + 0.5
    for top, chosen in zip(lp.top_logprobs[1:], got):
        assert len(top) == 1 and max(top.values()) >= chosen - 1e-6


def test_a_cache_hit_gives_the_cold_logprobs_and_streaming_the_same(base, smol_tokenizer):
    prompt = "A cache hit must not change a prompt's score: " + TEXTS[0]
    cold = _echo(base, prompt).logprobs
    for _ in range(2):                          # a plain request leaves the prompt's pages in the prefix cache
        r = _client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details is None or r.usage.prompt_tokens_details.cached_tokens > 0
    warm = _echo(base, prompt).logprobs
    assert warm.tokens == cold.tokens
    assert warm.token_logprobs[1:] == pytest.approx(cold.token_logprobs[1:], abs=1e-4)
    one = _echo(base, prompt, max_tokens=1, logprobs=3)      # lm-eval's request: the prompt then one new token
    assert len(one.logprobs.tokens) == len(cold.tokens) + 1 and one.logprobs.token_logprobs[-1] is not None
    assert one.logprobs.token_logprobs[1:-1] == pytest.approx(cold.token_logprobs[1:], abs=1e-4)
    assert all(len(t) == 3 for t in one.logprobs.top_logprobs[1:])
    events = _echo(base, prompt, max_tokens=1, logprobs=3, stream=True)
    streamed = [x for e in events for c in e.choices if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed[1:] == pytest.approx(one.logprobs.token_logprobs[1:], abs=1e-4) and streamed[0] is None
    assert "".join(c.text for e in events for c in e.choices) == one.text


def test_max_tokens_zero_needs_echo_and_reports_no_completion(base):
    with pytest.raises(openai.BadRequestError) as e:
        _client(base).completions.create(model=MODEL, prompt="hello there", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    r = _client(base).completions.create(model=MODEL, prompt="hello there", max_tokens=0, echo=True, logprobs=0)
    assert r.usage.completion_tokens == 0 and r.choices[0].text == "hello there"


def _task(tmp_path: Path) -> Path:
    (tmp_path / "edgeinfer_facts.yaml").write_text(
        "task: edgeinfer_facts\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {FACTS}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\n"
        "target_delimiter: ' '\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return tmp_path


def _evaluate(tmp_path: Path, model: str, model_args: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=["edgeinfer_facts"],
                          task_manager=TaskManager(include_path=str(_task(tmp_path))), log_samples=True,
                          batch_size=4, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    assert out is not None
    res = out["results"]["edgeinfer_facts"]
    lls = [r[0][0] for s in out["samples"]["edgeinfer_facts"] for r in s["resps"]]
    return {"acc": res["acc,none"], "acc_norm": res["acc_norm,none"], "lls": lls}


def test_lm_evaluation_harness_scores_the_served_model_like_transformers(base, smol_dir, tmp_path, monkeypatch):
    """lm-eval's local-completions model (echo + logprobs, max_tokens 1) against `edgeinfer serve`, and its hf model
    on transformers, on the same task: the same accuracy, the same per-choice log-likelihoods to within fp8 KV's
    rounding."""
    monkeypatch.setenv("OPENAI_API_KEY", DEMO_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = _evaluate(tmp_path, "local-completions",
                     f"model={MODEL},base_url={base}/v1/completions,tokenizer_backend=remote,auth_token={DEMO_KEY},"
                     "num_concurrent=2,max_retries=1,tokenized_requests=True")
    theirs = _evaluate(tmp_path, "hf", f"pretrained={smol_dir},dtype=float32,device=cpu")
    diffs = [abs(a - b) for a, b in zip(ours["lls"], theirs["lls"])]
    record = {"task": "edgeinfer_facts (24 items x 4 choices)", "edgeinfer": {k: ours[k] for k in ("acc", "acc_norm")},
              "transformers": {k: theirs[k] for k in ("acc", "acc_norm")},
              "loglikelihood_mean_abs_diff": sum(diffs) / len(diffs), "loglikelihood_max_abs_diff": max(diffs)}
    print(json.dumps(record))
    assert len(ours["lls"]) == len(theirs["lls"]) == 96 and all(math.isfinite(x) for x in ours["lls"])
    assert abs(ours["acc"] - theirs["acc"]) <= 1 / 24 + 1e-9
    assert record["loglikelihood_mean_abs_diff"] < 0.15
