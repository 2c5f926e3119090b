"""`response_format` -> the backend's Constraint (a JSON Schema the output must match).

{"type": "text"} is no constraint; {"type": "json_object"} is any JSON object; {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}} is that schema. The schema is checked here against the JSON
Schema meta-schema, so a mistake is a 400 naming its place (param "response_format.json_schema.schema.
properties.age.type"); what the grammar compiler cannot do (on the backend) is a 400 with its message.
"""

from __future__ import annotations

import json
from typing import Any

from edgeinfer.gateway.errors import APIError
from edgeinfer.protocol.wire import Constraint

ANY_OBJECT = Constraint("json_schema", '{"type":"object"}')
_PARAM = "response_format"


def _bad(message: str, param: str = _PARAM) -> APIError:
    return APIError(400, message, param=param, code="invalid_response_format")


def _check_schema(schema: Any, param: str) -> None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise _bad(f"{param}{where} is not valid JSON Schema: {e.message}", f"{param}{where}") from e


def constraint_for(response_format: dict[str, Any] | None) -> Constraint | None:
    """The Constraint for a response_format, or None for plain text; APIError 400 naming the bad part."""
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
    _check_schema(schema, f"{_PARAM}.json_schema.schema")
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
                      guided_regex: str | None) -> Constraint | None:
    """vLLM's guided_json / guided_choice / guided_regex onto the same grammar path (check_common allows one)."""
    if guided_json is not None:
        schema = guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise _bad(f"guided_json is not valid JSON: {e}", "guided_json") from e
        _check_schema(schema, "guided_json")
        return schema_constraint(schema)
    if guided_choice is not None:
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in guided_choice)
        return Constraint("lark", f"start: {alternatives}")
    if guided_regex is not None:
        import re

        try:
            re.compile(guided_regex)
        except re.error as e:
            raise _bad(f"guided_regex is not a valid regular expression: {e}", "guided_regex") from e
        return Constraint("regex", guided_regex)
    return None
