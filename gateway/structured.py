"""`response_format` -> the backend's Constraint (a JSON Schema the output must match).

{"type": "text"} is no constraint; {"type": "json_object"} is any JSON object; {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}} is that schema. A schema passes two checks:

- `measure`, on the event loop, before admission: size, depth, property count, alternatives (anyOf / oneOf /
  allOf branches, enum values, guided_choice values), each against `SchemaLimits`; the walk is iterative and
  stops at the first limit passed, so its cost is bounded whatever the request holds (a 2.8 MB schema of
  100,000 properties stops after max_properties + 1 of them). A limit passed is a 400 naming it.
- `check_schema`, the JSON Schema meta-schema (jsonschema, pure Python: 0.2 s for 1,000 required properties,
  quadratic in `required`), after admission and off the event loop (gateway/schema_guard.py), so a mistake is
  a 400 naming its place (param "response_format.json_schema.schema.properties.age.type").

What the grammar compiler cannot do (on the backend) is a 400 with its message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from edgeinfer.gateway.errors import APIError
from edgeinfer.protocol.wire import Constraint


class Pending(list[tuple[Any, str]]):
    """(schema, param) pairs still to be checked against the meta-schema (schema_guard.SchemaGuard.check)."""


@dataclass(frozen=True)
class SchemaLimits:
    """Caps on one request's schemas (server.max_schema_*; docs/GATEWAY.md "Limits")."""
    max_bytes: int = 128 << 10          # one schema as compact JSON
    max_depth: int = 64                 # JSON nesting levels of one schema (or of a free-form field)
    max_properties: int = 1000          # keys of every `properties` object of one schema, together
    max_alternatives: int = 1000        # anyOf / oneOf / allOf branches and enum values of one schema, together
    max_tools: int = 128                # OpenAI's own cap on tools per request

    @classmethod
    def of(cls, server: Any) -> SchemaLimits:
        return cls(server.max_schema_bytes, server.max_schema_depth, server.max_schema_properties,
                   server.max_schema_alternatives, server.max_tools)


DEFAULT_LIMITS = SchemaLimits()
_ALTERNATIVES = ("anyOf", "oneOf", "allOf", "enum")


def _too_big(param: str, what: str, limit: int, setting: str) -> APIError:
    return APIError(400, f"{param} {what}: at most {limit} are accepted (server.{setting})", param=param,
                    code="schema_too_large")


def _containers(value: Any, param: str, limits: SchemaLimits):
    """Every dict and list in value (decoded JSON), depth-first, without recursion; a 400 naming `param` at the
    first one deeper than limits.max_depth (so the walk never goes past that depth)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise _too_big(param, f"nests more than {limits.max_depth} levels deep", limits.max_depth,
                           "max_schema_depth")
        yield node
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def check_depth(value: Any, param: str, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    """400 naming `param` when value (decoded JSON) nests deeper than limits.max_depth."""
    if isinstance(value, (dict, list)):
        for _ in _containers(value, param, limits):
            pass


def measure(schema: Any, param: str, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    """400 naming the limit when the schema passes one of `limits`; stops at the first (bounded work)."""
    properties = alternatives = 0
    for node in _containers(schema, param, limits):
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            properties += len(props)
            if properties > limits.max_properties:
                raise _too_big(param, f"has more than {limits.max_properties} properties", limits.max_properties,
                               "max_schema_properties")
        for key in _ALTERNATIVES:
            alts = node.get(key)
            if isinstance(alts, list):
                alternatives += len(alts)
                if alternatives > limits.max_alternatives:
                    raise _too_big(param, f"has more than {limits.max_alternatives} alternatives "
                                          "(anyOf / oneOf / allOf branches and enum values)",
                                   limits.max_alternatives, "max_schema_alternatives")
    size = len(json.dumps(schema, separators=(",", ":")))   # bounded by the caps above and max_body_bytes
    if size > limits.max_bytes:
        raise _too_big(param, f"is {size} bytes as compact JSON", limits.max_bytes, "max_schema_bytes")

ANY_OBJECT = Constraint("json_schema", '{"type":"object"}')
_PARAM = "response_format"


def _bad(message: str, param: str = _PARAM) -> APIError:
    return APIError(400, message, param=param, code="invalid_response_format")


Problem = tuple[str, str] | None     # (param of the bad part, message), or None: the schema is valid


def schema_problem(schema: Any, param: str) -> Problem:
    """(param of the bad part, message) when schema is not valid JSON Schema, else None. Pure Python and
    picklable both ways: what gateway/schema_guard.py runs in its worker processes."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, dict):
        return param, f"{param} must be a JSON Schema object, got {type(schema).__name__}"
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        return f"{param}{where}", f"{param}{where} is not valid JSON Schema: {e.message}"
    except RecursionError:
        return param, f"{param} nests too deeply to be checked"
    return None


def raise_problem(problem: Problem) -> None:
    if problem is not None:
        raise _bad(problem[1], problem[0])


def check_schema(schema: Any, param: str, limits: SchemaLimits = DEFAULT_LIMITS,
                 pending: Pending | None = None) -> None:
    """The limits now; the meta-schema now (pending None) or later, off the loop (appended to pending)."""
    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    measure(schema, param, limits)
    if pending is None:
        raise_problem(schema_problem(schema, param))
    else:
        pending.append((schema, param))


def constraint_for(response_format: dict[str, Any] | None, limits: SchemaLimits = DEFAULT_LIMITS,
                   pending: Pending | None = None) -> Constraint | None:
    """The Constraint for a response_format, or None for plain text; APIError 400 naming the bad part.
    With `pending`, the schema's meta-schema check is left to the caller (schema_guard.SchemaGuard.check)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise _bad(f"response_format.type={kind!r} is not supported: expected 'text', 'json_object' or "
                   f"'json_schema'", f"{_PARAM}.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema is required for type 'json_schema': an object with "
                   "'name' and 'schema'", f"{_PARAM}.json_schema")
    schema = spec.get("schema", {"type": "object"})
    check_schema(schema, f"{_PARAM}.json_schema.schema", limits, pending)
    return schema_constraint(schema)


SAFE_INT = 2**53 - 1    # JSON's safe integers: at most 16 digits


def bounded_numbers(node: Any) -> Any:
    """A copy of the schema where every integer or number without a bound gets JSON's safe-integer range
    (+-(2**53 - 1)). A small model at temperature 0 otherwise writes `11111111...` into an unbounded integer
    until max_tokens (measured: `chat.completions.parse(response_format=City)` ran out at 96 and 128 tokens);
    with the bound the grammar allows at most 16 digits, then the number must end. Every value this admits is
    still valid under the user's schema, and a JSON parser reads it exactly (docs/GATEWAY.md)."""
    if isinstance(node, list):
        return [bounded_numbers(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded_numbers(v) for k, v in node.items()}
    kinds = node.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if any(k in ("integer", "number") for k in kinds) and "const" not in node and "enum" not in node:
        if "minimum" not in node and "exclusiveMinimum" not in node:
            out["minimum"] = -SAFE_INT
        if "maximum" not in node and "exclusiveMaximum" not in node:
            out["maximum"] = SAFE_INT
    return out


def schema_constraint(schema: dict[str, Any]) -> Constraint:
    """The schema as compact JSON text, its keys in the order given: the grammar emits an object's properties
    in the order of `properties`, as OpenAI's structured outputs do (never sorted: pydantic's field order is
    the order a user reads and a model is prompted in). Unbounded numbers get bounded_numbers()' range."""
    return Constraint("json_schema", json.dumps(bounded_numbers(schema), separators=(",", ":")))


def guided_constraint(guided_json: dict[str, Any] | str | None, guided_choice: list[str] | None,
                      guided_regex: str | None, limits: SchemaLimits = DEFAULT_LIMITS,
                      pending: Pending | None = None) -> Constraint | None:
    """vLLM's guided_json / guided_choice / guided_regex onto the same grammar path (check_common allows one)."""
    if guided_json is not None:
        schema = guided_json
        if isinstance(schema, str):
            if len(schema) > limits.max_bytes:
                raise _too_big("guided_json", f"is {len(schema)} characters", limits.max_bytes, "max_schema_bytes")
            try:
                schema = json.loads(schema)
            except RecursionError as e:
                raise _too_big("guided_json", "nests too deeply to be parsed", limits.max_depth,
                               "max_schema_depth") from e
            except ValueError as e:
                raise _bad(f"guided_json is not valid JSON: {e}", "guided_json") from e
        check_schema(schema, "guided_json", limits, pending)
        return schema_constraint(schema)
    if guided_choice is not None:
        if len(guided_choice) > limits.max_alternatives:
            raise _too_big("guided_choice", f"has {len(guided_choice)} values", limits.max_alternatives,
                           "max_schema_alternatives")
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in guided_choice)
        return Constraint("lark", f"start: {alternatives}")
    if guided_regex is not None:
        try:
            re.compile(guided_regex)
        except re.error as e:
            raise _bad(f"guided_regex is not a valid regular expression: {e}", "guided_regex") from e
        return Constraint("regex", guided_regex)
    return None
