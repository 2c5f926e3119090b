"""OpenAPI 3.1 document generated from the msgspec wire structs (schemas.py)."""

from __future__ import annotations

import msgspec

from edgeinfer.gateway import schemas
from edgeinfer.gateway.errors import ErrorBody

_STRUCTS = (schemas.ChatCompletionRequest, schemas.CompletionRequest, schemas.ChatCompletion,
            schemas.ChatCompletionChunk, schemas.Completion, schemas.ModelList, ErrorBody)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": d, "content": {"application/json": {"schema": _ref("ErrorBody")}}}
            for c, d in ((400, "invalid value or unsupported feature"), (401, "missing or invalid API key"),
                         (403, "model not enabled for this key"), (404, "unknown model"),
                         (413, "request body too large"),
                         (429, "rate or concurrency limit; see Retry-After and x-ratelimit-*"),
                         (503, "no healthy backend or shutting down")) if c in codes}


def _generate(request: str, response: str, chunk: str) -> dict:
    return {"post": {
        "security": [{"bearer": []}],
        "parameters": [{"name": "x-session-affinity", "in": "header", "required": False,
                        "schema": {"type": "string"}, "description": "sticky routing key for multi-turn sessions"}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "completion (JSON) or, with stream=true, SSE of chunks then [DONE]",
                              "content": {"application/json": {"schema": _ref(response)},
                                          "text/event-stream": {"schema": _ref(chunk)}}},
                      **_errors(400, 401, 403, 404, 413, 429, 503)}}}


def openapi_document() -> dict:
    _, components = msgspec.json.schema_components(_STRUCTS, ref_template="#/components/schemas/{name}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "edgeinfer gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible multi-tenant inference API"},
        "paths": {
            "/v1/chat/completions": _generate("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
            "/v1/completions": _generate("CompletionRequest", "Completion", "Completion"),
            "/v1/models": {"get": {"security": [{"bearer": []}],
                                   "responses": {"200": {"description": "models this key may use",
                                                         "content": {"application/json": {
                                                             "schema": _ref("ModelList")}}},
                                                 **_errors(401)}}},
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
