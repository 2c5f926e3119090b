"""Tools (function calling): the request's tools rendered into the prompt, the tool_choice turned into a
grammar, the model's output parsed into OpenAI tool_calls (whole or streamed).

Format (Hermes style, a documented fallback for every chat template, SmolLM2's included, which has no tool
syntax of its own): the tools are listed in the system message as JSON inside <tools></tools>; the model
calls one as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>; an earlier assistant call is
rendered the same way and a `tool` message as a user turn <tool_response>\\n...\\n</tool_response>.
tool_choice "required" or a named function constrains the output to such calls (an llguidance Lark
grammar embedding each function's parameters schema); "auto" leaves the model free and parses what it
wrote; "none" renders no tools.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from edgeinfer.gateway.errors import APIError
from edgeinfer.gateway.structured import DEFAULT_LIMITS, Pending, SchemaLimits, check_schema
from edgeinfer.protocol.wire import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_SYSTEM = ("You are a function calling AI model. You may call one or more functions to assist with the user "
           "query. Here are the available functions:\n<tools>\n{tools}\n</tools>\nFor each function call, "
           "return a JSON object with the function name and arguments within <tool_call></tool_call> tags:\n"
           "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}}


def strict_schema(schema: Any) -> Any:
    """A function's parameters schema as a forced call must follow it: every object that declares its properties
    and says nothing of others gets additionalProperties false (JSON Schema would let the model add keys, and a
    small model does: `{"city": "Paris", "type": "string", ...` ran past max_tokens). A schema that allows more
    (additionalProperties true or a schema, patternProperties) keeps it."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else strict_schema(v)) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: strict_schema(v) for k, v in schema["properties"].items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_tools")


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str                    # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ToolCallDelta(msgspec.Struct):
    index: int
    id: str
    function: FunctionCall
    type: str = "function"


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[dict[str, Any], ...]    # {"name", "description"?, "parameters"?}
    mode: str                                # "auto" | "required" | "named"
    name: str | None = None
    parallel: bool = True

    def constraint(self) -> Constraint | None:
        if self.mode == "auto":
            return None
        chosen = [f for f in self.functions if self.mode == "required" or f["name"] == self.name]
        bodies = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                    "arguments": strict_schema(f.get("parameters") or NO_ARGS)},
                   "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
        body: dict[str, Any] = dict(bodies[0]) if len(bodies) == 1 else {"anyOf": bodies}
        body["x-guidance"] = {"whitespace_flexible": False}     # compact JSON: no room for endless blanks
        start = 'start: call ("\\n" call)*' if self.parallel else "start: call"
        lark = (f'{start}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\n'
                f"body: %json {json.dumps(body, separators=(',', ':'))}\n")
        return Constraint("lark", lark)

    @property
    def forced_names(self) -> tuple[str, ...]:
        """The functions a forced call (required / named) may name; () when the model is free."""
        if self.mode == "auto":
            return ()
        return tuple(f["name"] for f in self.functions if self.mode == "required" or f["name"] == self.name)

    def system_text(self) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                           for f in self.functions if self.mode != "named" or f["name"] == self.name)
        return _SYSTEM.format(tools=listed)


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel: bool | None, limits: SchemaLimits = DEFAULT_LIMITS,
               pending: Pending | None = None) -> ToolPlan | None:
    """None when no tools are offered (or tool_choice is "none"); APIError 400 naming the bad part.
    Each function's parameters schema passes structured.check_schema (with `pending`: its meta-schema check
    is left to the caller, off the event loop)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "tool_choice needs tools")
        return None
    if len(tools) > limits.max_tools:
        raise APIError(400, f"tools has {len(tools)} functions: at most {limits.max_tools} are accepted "
                            "(server.max_tools)", param="tools", code="too_many_tools")
    functions = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
            raise _bad(f"tools[{i}].function.name", f"tools[{i}].function.name={name!r} is invalid: expected "
                                                    f"letters, digits, '_' or '-'")
        params = f.get("parameters")
        if params is not None:
            check_schema(params, f"tools[{i}].function.parameters", limits, pending)
        functions.append({k: f[k] for k in ("name", "description", "parameters") if k in f})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _bad("tools", f"function names must be unique: {names}")
    par = True if parallel is None else parallel
    if tool_choice in (None, "auto"):
        return ToolPlan(tuple(functions), "auto", parallel=par)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolPlan(tuple(functions), "required", parallel=par)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") == "function" and name in names:
            return ToolPlan(tuple(functions), "named", name, parallel=False)
        raise _bad("tool_choice", f"tool_choice names function {name!r}, which is not among the tools {names}")
    raise _bad("tool_choice", f"tool_choice={tool_choice!r} is invalid: expected 'none', 'auto', 'required' or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")


def _call_text(call: dict[str, Any], i: int) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as e:
        raise _bad(f"messages[{i}].tool_calls", f"tool call arguments are not JSON: {e}") from e
    return f"{OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': parsed}, ensure_ascii=False)}\n{CLOSE}"


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Messages as dicts ({"role", "content", "tool_calls"?}) -> dicts a plain chat template renders."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c, i) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if plan is not None:
        text = plan.system_text()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _parse_call(body: str) -> FunctionCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return FunctionCall(obj["name"], json.dumps(args, ensure_ascii=False))


_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(.*)$', re.S)
_ARGS = re.compile(r'^\s*,\s*"arguments"\s*:\s*(.*)$', re.S)


def _partial_call(body: str, names: tuple[str, ...] = ()) -> FunctionCall | None:
    """A call max_tokens cut off: its name and the arguments' JSON text so far ("" if none yet). A name cut off
    (or not begun) counts when it can only be one of `names`."""
    body = body[:len(body) - _partial_suffix(body, "\n" + CLOSE)] if not body.endswith("}") else body
    whole = _parse_call(body.strip())
    if whole is not None:             # only the closing tag was cut off
        return whole
    m = _NAME.match(body)
    if m is not None:
        args = _ARGS.match(m.group(2))
        return FunctionCall(json.loads(f'"{m.group(1)}"'), args.group(1).rstrip() if args else "")
    # a forced call is compact JSON (ToolPlan.constraint): what was written is a prefix of {"name":"<function>"
    fits = [n for n in names if json.dumps({"name": n}, separators=(",", ":")).startswith(body.strip())]
    return FunctionCall(fits[0], "") if len(fits) == 1 else None


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


class ToolCallParser:
    """Splits one choice's streamed text into content and complete tool calls. `names`: the functions a forced
    call may name (a call cut off inside its name is completed to the one name it can only be)."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.names = names
        self.buf = ""
        self.inside = False
        self.calls: list[ToolCall] = []
        self.content_seen = False

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to emit now, calls completed by this text)."""
        self.buf += text
        content, calls = "", []
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if end < 0:
                    break
                body, self.buf, self.inside = self.buf[:end], self.buf[end + len(CLOSE):], False
                fc = _parse_call(body)
                if fc is None:
                    content += f"{OPEN}{body}{CLOSE}"
                else:
                    calls.append(ToolCall(new_call_id(), fc))
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                content += self.buf[:start]
                self.buf, self.inside = self.buf[start + len(OPEN):], True
                continue
            keep = _partial_suffix(self.buf, OPEN)
            content += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            break
        self.calls += calls
        return self._content(content), calls

    def finish(self, reason: str | None = None) -> str:
        """The rest as content. A call cut off by max_tokens (reason "length", inside a call) with no complete call
        before it is kept as a tool call whose arguments are the partial JSON written so far, as OpenAI answers
        (finish "length", the partial call visible): never an empty answer; after complete calls (parallel calls)
        the cut one is dropped (a client cannot run it). A call cut before its name is known stays as text. The
        start of a tag cut off is dropped; an unterminated call at a natural stop is left as text (the model wrote
        it that way)."""
        if reason == "length" and self.inside:
            body, self.buf, self.inside = self.buf, "", False
            if self.calls:        # complete calls came before it: they are the answer, the cut one is dropped
                return ""
            partial = _partial_call(body, self.names)
            if partial is not None:
                self.calls.append(ToolCall(new_call_id(), partial))
                return ""
            return self._content(OPEN + body)
        if reason == "length" and self.buf:
            self.buf = ""
            return ""
        rest = (OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return self._content(rest)

    def _content(self, text: str) -> str:
        if not self.content_seen and not text.strip():
            return ""           # blank lines around tool calls are not content
        self.content_seen = True
        return text


class ToolStream:
    """One streamed choice: content deltas, then each tool call as one OpenAI tool_calls delta."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.parser = ToolCallParser(names)

    def step(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCallDelta] | None, str | None]:
        base = len(self.parser.calls)
        content, calls = self.parser.push(text)
        if reason is not None:
            before = len(self.parser.calls)
            content += self.parser.finish(reason)
            calls = [*calls, *self.parser.calls[before:]]       # a call cut off by max_tokens, partial
            if self.parser.calls and reason == "stop":
                reason = "tool_calls"
        deltas = [ToolCallDelta(base + k, c.id, c.function) for k, c in enumerate(calls)]
        return content or None, deltas or None, reason


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_output(text: str, reason: str | None = None,
                 names: tuple[str, ...] = ()) -> tuple[str | None, list[ToolCall]]:
    """Whole output -> (content or None, tool calls); reason is the choice's finish_reason; names: see
    ToolCallParser."""
    p = ToolCallParser(names)
    content, _ = p.push(text)
    content += p.finish(reason)
    calls = p.calls                  # with a call max_tokens cut off (partial arguments)
    content = content.strip() if calls else content
    return (content or None), calls
