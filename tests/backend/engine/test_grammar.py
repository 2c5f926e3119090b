"""Grammar-constrained decoding in the real engine on SmolLM2-135M: the batch mask, the grammar state per
sequence, the stop when the grammar is complete, the compile cache and the refusal of bad/costly schemas."""

from __future__ import annotations

import asyncio
import itertools
import json

import jsonschema
import pytest

from edgeinfer.backend.engine.engine import LLMEngine, RequestError
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.grammar import GrammarCompiler, GrammarLimits, apply_masks
from edgeinfer.protocol.wire import Constraint, GenerateRequest, SamplingParams

_ids = itertools.count()

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smol_model, smol_tokenizer):
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(max_num_seqs=8, num_pages=256))
    eng.start()
    yield eng
    eng.stop()


def schema(s: dict) -> Constraint:
    return Constraint("json_schema", json.dumps(s))


async def run(eng: LLMEngine, prompt: list[int], constraint: Constraint | None, **sp):
    sp.setdefault("temperature", 0)
    req = GenerateRequest(f"g-{next(_ids)}", prompt, SamplingParams(**sp), "t", constraint=constraint)
    text, last = "", None
    async for c in eng.generate(req):
        text += c.text
        last = c
    return text, last


def chat(tok, text: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


async def test_constrained_output_validates_and_stops_when_complete(engine, smol_tokenizer):
    prompt = chat(smol_tokenizer, "Describe a user as JSON with name, age and role.")
    text, last = await run(engine, prompt, schema(PERSON), max_tokens=60)
    jsonschema.validate(json.loads(text), PERSON)
    assert last.finish_reason == "stop"
    free, _ = await run(engine, prompt, None, max_tokens=30)
    with pytest.raises(ValueError):        # the same prompt unconstrained is prose, not this JSON
        jsonschema.validate(json.loads(free), PERSON)


async def test_a_batch_of_different_schemas_and_free_text_decodes_together(engine, smol_tokenizer):
    schemas = [PERSON,
               {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2,
                "maxItems": 4},
               {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False},
               {"enum": ["red", "green", "blue"]}]
    prompt = chat(smol_tokenizer, "Answer in JSON.")
    jobs = [run(engine, prompt, schema(s), max_tokens=60) for s in schemas]
    jobs.append(run(engine, prompt, None, max_tokens=20, ignore_eos=True))
    res = await asyncio.gather(*jobs)
    for s, (text, last) in zip(schemas, res[:-1]):
        jsonschema.validate(json.loads(text), s)
        assert last.finish_reason == "stop"
    assert res[-1][1].usage.completion_tokens == 20       # the unconstrained neighbour is unaffected


async def test_json_object_mode_and_lark(engine, smol_tokenizer):
    text, _ = await run(engine, chat(smol_tokenizer, "Give me JSON."), schema({"type": "object"}),
                        max_tokens=80, temperature=0.8, seed=3)
    assert isinstance(json.loads(text), dict) or text.startswith("{")      # may hit max_tokens mid-object
    lark = 'start: "Answer: " ("yes" | "no")'
    text, last = await run(engine, chat(smol_tokenizer, "Is water wet?"), Constraint("lark", lark), max_tokens=10)
    assert text in ("Answer: yes", "Answer: no") and last.finish_reason == "stop"


async def test_bad_schema_is_a_request_error_naming_the_part(engine, smol_tokenizer):
    with pytest.raises(RequestError, match="integr"):
        await run(engine, [1, 2, 3], schema({"type": "object", "properties": {"a": {"type": "integr"}}}))
    with pytest.raises(RequestError, match="not supported"):
        await run(engine, [1, 2, 3], Constraint("regexp", "a+"))


async def test_compiles_once_per_schema(engine, smol_tokenizer):
    g = engine.grammars
    s = schema({"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    before = g.compiles
    await asyncio.gather(*[run(engine, [1, 2, 3], s, max_tokens=8) for _ in range(3)])
    await run(engine, [1, 2, 3], s, max_tokens=8)
    assert g.compiles - before <= 2     # two pool threads may race on the first; never once per request


def test_too_costly_schema_is_refused_not_hung(smol_tokenizer):
    g = GrammarCompiler(smol_tokenizer, 49152, GrammarLimits(initial_lexer_fuel=10_000))
    wide = {"type": "object", "properties": {f"p{i}": {"enum": [f"v{i}_{j}" for j in range(40)]}
                                             for i in range(60)}}
    with pytest.raises(ValueError, match="too costly to compile.*limit"):
        g.compile(schema(wide))
    big = GrammarCompiler(smol_tokenizer, 49152, GrammarLimits(max_spec_bytes=100))
    with pytest.raises(ValueError, match="at most 100"):
        big.compile(schema(wide))


def test_mask_rows_only_for_constrained_sequences(smol_tokenizer):
    import torch

    g = GrammarCompiler(smol_tokenizer, 49152)
    m = g.matcher(Constraint("lark", 'start: "yes"'))
    logits = torch.zeros(3, 49152)
    apply_masks(g, [(1, m)], logits)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(smol_tokenizer.decode([t]) and "yes".startswith(smol_tokenizer.decode([t]))
                           for t in allowed)


# ---- grammar fast-forward (engine._fast_forward): forced tokens without a model step each
TOOL = {"type": "object", "properties": {
    "function": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}},
    "required": ["function", "arguments"], "additionalProperties": False}


@pytest.mark.parametrize("ff", [True, False])
async def test_fast_forward_emits_forced_tokens_without_a_step_each(smol_model, smol_tokenizer, ff):
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(max_num_seqs=4, num_pages=128, grammar_fast_forward=ff))
    eng.start()
    try:
        prompt = chat(smol_tokenizer, "Call the weather tool for Paris in celsius, as JSON.")
        steps0 = eng.steps
        text, last = await run(eng, prompt, schema(TOOL), max_tokens=80)
        steps = eng.steps - steps0
    finally:
        eng.stop()
    obj = json.loads(text)
    jsonschema.validate(obj, TOOL)
    assert obj["function"] == "get_weather" and last.finish_reason == "stop"
    n = last.usage.completion_tokens
    if ff:
        # the keys, the constant and the punctuation were forced: far fewer steps than tokens
        assert eng.fast_forwarded >= 8 and steps <= n - eng.fast_forwarded + 2
    else:
        assert eng.fast_forwarded == 0 and steps >= n


async def test_fast_forward_is_off_for_a_request_that_wants_logprobs(smol_model, smol_tokenizer):
    eng = LLMEngine(smol_model, smol_tokenizer, EngineConfig(max_num_seqs=4, num_pages=128))
    eng.start()
    try:
        prompt = chat(smol_tokenizer, "Call the weather tool for Paris, as JSON.")
        req = GenerateRequest("lp-ff", prompt, SamplingParams(temperature=0, max_tokens=80, logprobs=True), "t",
                              constraint=schema(TOOL))
        chunks = [c async for c in eng.generate(req)]
    finally:
        eng.stop()
    assert eng.fast_forwarded == 0
    assert sum(len(c.token_ids) for c in chunks) == sum(len(c.logprobs or []) for c in chunks)   # one each
