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
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":"), sort_keys=True))
