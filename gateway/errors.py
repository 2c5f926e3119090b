"""OpenAI-style API errors: one exception type, mapped to JSON by one middleware (app.py)."""

from __future__ import annotations

import re

import msgspec


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error")

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))


_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def from_validation_error(e: msgspec.ValidationError) -> APIError:
    """msgspec's 'Expected `int`, got `str` - at `$.n`' -> 400 with param='n', as OpenAI answers every request
    validation error (a 422 is UnprocessableEntityError in the openai SDK, which code written for OpenAI does not
    catch as BadRequestError); a missing field -> 400 naming it (param); an unknown field -> 400 naming it
    ('Unrecognized request argument supplied: foo')."""
    text = str(e)
    m = _AT.search(text)
    param = m.group(1) if m else None
    if u := re.search(r"unknown field `([^`]*)`", text):
        where = f"{param}.{u.group(1)}" if param else u.group(1)
        return APIError(400, f"Unrecognized request argument supplied: {where}", code="unknown_parameter",
                        param=where)
    if miss := re.search(r"missing required field `([^`]*)`", text):
        where = f"{param}.{miss.group(1)}" if param else miss.group(1)
        return APIError(400, f"Missing required parameter: '{where}'.", code="missing_required_parameter",
                        param=where)
    return APIError(400, text, code="invalid_type" if "Expected" in text else "invalid_field", param=param)


def bad_value(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)
