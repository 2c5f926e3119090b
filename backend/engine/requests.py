"""A request's checks before it reaches the scheduler: each failure a RequestError naming the value and what was
expected, with the HTTP-like code the backend answers (400; 409 for a request id already running)."""

from __future__ import annotations

from typing import Any

from edgeinfer.protocol.wire import GenerateRequest


class RequestError(ValueError):
    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


def validate_request(engine: Any, req: GenerateRequest) -> None:
    """req as this engine can serve it, or a RequestError naming the value and what was expected."""
    try:
        req.sampling.validate()
    except ValueError as e:
        raise RequestError(str(e)) from e
    n = len(req.prompt_token_ids)
    if n == 0:
        raise RequestError("prompt_token_ids is empty: expected at least 1 token")
    vocab = engine.model.cfg.vocab_size
    bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is out of range: expected 0 <= id < {vocab}")
    if n >= engine.max_model_len:
        raise RequestError(f"prompt has {n} tokens; this model accepts at most {engine.max_model_len - 1}", 400)
    if engine.blocks.pages_needed(n + 1) > engine.blocks.num_pages:
        raise RequestError(f"prompt of {n} tokens needs {engine.blocks.pages_needed(n + 1)} KV pages; the KV "
                           f"cache has {engine.blocks.num_pages} pages of {engine.cfg.page_size} tokens", 400)
    if engine.has_request(req.request_id):
        raise RequestError(f"request_id {req.request_id!r} is already running", 409)
    if not req.cache_namespace:
        raise RequestError("cache_namespace is empty: expected the tenant's namespace")
    if req.tenant is not None:
        try:
            req.tenant.validate()
        except ValueError as e:
            raise RequestError(str(e)) from e
        cap = req.tenant.max_running_pages
        if cap and engine.blocks.pages_needed(n + 1) > cap:
            raise RequestError(f"prompt of {n} tokens needs {engine.blocks.pages_needed(n + 1)} KV pages; tenant "
                               f"{req.tenant.id!r} may hold at most {cap} (max_running_pages)", 400)
