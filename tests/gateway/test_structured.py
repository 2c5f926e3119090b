"""gateway/structured.py and gateway/tools.py alone: response_format -> Constraint, tool plans, rendering,
and the tool-call parser (whole and streamed), checked against llguidance where a grammar is produced."""

from __future__ import annotations

import json

import llguidance as llg
import pytest

from edgeinfer.gateway.errors import APIError
from edgeinfer.gateway.structured import constraint_for
from edgeinfer.gateway.tools import ToolCallParser, ToolStream, plan_tools, render_messages, split_output

FN = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FN2 = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_response_format_to_constraint():
    assert constraint_for(None) is None and constraint_for({"type": "text"}) is None
    assert json.loads(constraint_for({"type": "json_object"}).spec) == {"type": "object"}
    c = constraint_for({"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                               "schema": {"type": "integer", "maximum": 3}}})
    # the user's bound kept, the missing one filled with JSON's safe range (structured.bounded_numbers)
    assert c.kind == "json_schema" and json.loads(c.spec) == {"type": "integer", "maximum": 3,
                                                              "minimum": -(2**53 - 1)}


def test_schema_keys_keep_their_order_and_unbounded_numbers_get_the_safe_range():
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                               "population": {"type": "integer"}, "share": {"type": "number",
                                                                                            "exclusiveMinimum": 0}},
              "required": ["name", "country", "population"]}
    c = constraint_for({"type": "json_schema", "json_schema": {"name": "City", "schema": schema}})
    got = json.loads(c.spec)
    assert list(got["properties"]) == ["name", "country", "population", "share"]    # not sorted
    assert got["properties"]["population"] == {"type": "integer", "minimum": -(2**53 - 1), "maximum": 2**53 - 1}
    assert got["properties"]["share"] == {"type": "number", "exclusiveMinimum": 0, "maximum": 2**53 - 1}
    assert got["properties"]["name"] == {"type": "string"}


@pytest.mark.parametrize("rf, param", [
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "integr"}}}}},
     "response_format.json_schema.schema.properties.a.type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "array", "items": [{"minimum": "x"}]}}},
     "response_format.json_schema.schema.items"),
])
def test_bad_response_format_names_the_part(rf, param):
    with pytest.raises(APIError) as e:
        constraint_for(rf)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tool_plans():
    assert plan_tools(None, None, None) is None
    assert plan_tools([FN], "none", None) is None
    assert plan_tools([FN], None, None).mode == "auto"
    assert plan_tools([FN], "auto", None).constraint() is None
    named = plan_tools([FN, FN2], {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.mode == "named" and named.name == "get_time" and not named.parallel
    for bad, param in [("sometimes", "tool_choice"), ({"type": "function", "function": {"name": "nope"}}, "tool_choice")]:
        with pytest.raises(APIError) as e:
            plan_tools([FN], bad, None)
        assert e.value.param == param
    with pytest.raises(APIError) as e:
        plan_tools([{"type": "function", "function": {"name": "a b"}}], None, None)
    assert e.value.param == "tools[0].function.name"
    with pytest.raises(APIError) as e:
        plan_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], None, None)
    assert e.value.param == "tools[0].function.parameters.type"
    with pytest.raises(APIError):
        plan_tools([FN, FN], None, None)
    with pytest.raises(APIError):
        plan_tools(None, "required", None)


def _lark_accepts(lark: str, text: str) -> bool:
    """Whether the grammar accepts text, with a byte-level tokenizer-free check (llguidance's own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    lt = llg.LLTokenizer(tok.to_str(), eos_token=len(alphabet))
    m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok.encode(text).ids
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_forced_grammars_accept_exactly_the_chosen_calls():
    named = plan_tools([FN, FN2], {"type": "function", "function": {"name": "get_weather"}}, None).constraint()
    ok = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    assert _lark_accepts(named.spec, ok)
    assert not _lark_accepts(named.spec, ok.replace("get_weather", "get_time"))
    assert not _lark_accepts(named.spec, ok + "\n" + ok)                 # named: one call
    assert not _lark_accepts(named.spec, '<tool_call>\n{"name":"get_weather","arguments":{}}\n</tool_call>')
    req = plan_tools([FN, FN2], "required", True).constraint()
    two = ok + '\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    assert _lark_accepts(req.spec, two)
    assert not _lark_accepts(req.spec, "Sure!")
    single = plan_tools([FN, FN2], "required", False).constraint()
    assert not _lark_accepts(single.spec, two) and _lark_accepts(single.spec, ok)


def test_render_tools_calls_and_results():
    plan = plan_tools([FN], None, None)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "content": "-3C"}]
    out = render_messages(msgs, plan)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n-3C\n</tool_response>"}
    assert render_messages([{"role": "user", "content": "hi"}], plan)[0]["role"] == "system"
    with pytest.raises(APIError):
        render_messages([{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}], None)


def test_split_output():
    content, calls = split_output('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                                  '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("f", {"a": 1}), ("g", {})]
    assert len({c.id for c in calls}) == 2
    assert split_output("just text") == ("just text", [])
    content, calls = split_output("Let me check. <tool_call>{not json}</tool_call>")
    assert calls == [] and content == "Let me check. <tool_call>{not json}</tool_call>"
    content, calls = split_output('Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "Sure." and calls[0].function.name == "f"


def test_a_call_cut_off_by_max_tokens():
    """Issue 54, item 7: a forced call max_tokens cut off is the partial call (finish "length"), never an empty
    answer; a name cut off is completed when one function fits; after complete calls the cut one is dropped."""
    def cut(text: str, names: tuple[str, ...] = ("get_weather",)):
        content, calls = split_output(text, "length", names)
        return content, [(c.function.name, c.function.arguments) for c in calls]

    assert cut('<tool_call>\n{"name":"get_weather","arguments":{"city":"Pa') == \
        (None, [("get_weather", '{"city":"Pa')])
    assert cut('<tool_call>\n{"name":"get_weather","argu') == (None, [("get_weather", "")])
    assert cut('<tool_call>\n{"name":"get_w') == (None, [("get_weather", "")])
    assert cut('<tool_call>\n') == (None, [("get_weather", "")])
    assert cut('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool') == \
        (None, [("get_weather", '{"city": "Paris"}')])                   # only the closing tag was cut
    assert cut('<tool_call>\n{"na', ("get_weather", "get_time")) == ('<tool_call>\n{"na', [])   # two fit: text
    two = '<tool_call>\n{"name":"get_weather","arguments":{}}\n</tool_call>\n<tool_call>\n{"name":"get_w'
    assert cut(two) == (None, [("get_weather", "{}")])                    # the cut second call is dropped
    s = ToolStream(("g",))
    assert s.step('<tool_call>\n{"name":"g","arguments":{"x":', None) == (None, None, None)
    content, deltas, reason = s.step("1", "length")
    assert reason == "length" and [(d.function.name, d.function.arguments) for d in deltas] == [("g", '{"x":1')]


def test_streamed_parser_splits_tags_across_chunks():
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"x": "</"}}\n</tool_call>'
    for size in (1, 2, 3, 7, len(text)):
        s = ToolStream()
        content, calls, reason = "", [], None
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for k, piece in enumerate(pieces):
            c, d, r = s.step(piece, "stop" if k == len(pieces) - 1 else None)
            content += c or ""
            calls += d or []
            reason = r or reason
        assert content == "Hi " and reason == "tool_calls", size
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [(0, "f", {"x": "</"})]
    p = ToolCallParser()
    assert p.push("<tool_") == ("", [])
    assert p.push("x> plain") == ("<tool_x> plain", [])
    assert ToolStream().step("no calls", "stop") == ("no calls", None, "stop")
