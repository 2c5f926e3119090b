"""RequestContext: what one request's handlers learn and the edge middleware reports (metrics, the access log,
the request's span): one typed object at `request[CONTEXT]` instead of string keys on the aiohttp request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from edgeinfer.gateway.schemas import UsageInfo


@dataclass
class RequestContext:
    request_id: str                     # echoed to the client (x-request-id), may be the client's own
    t0: float                           # perf_counter at arrival
    tenant: str = ""                    # set on authentication
    model: str = ""                     # the body's model, once decoded
    node: str = ""                      # the backend node(s) that served it
    route: str = ""                     # the routing decision (prefix hit, affinity, ...)
    usage: UsageInfo | None = None          # token counts, once known
    stream: web.StreamResponse | None = None             # a streaming response whose headers are out
    cut_event: Callable[[], bytes] | None = None         # the event that ends that stream at shutdown


CONTEXT: web.RequestKey[Any] = web.RequestKey("edgeinfer_context", RequestContext)


def context(request: web.Request) -> RequestContext:
    return request[CONTEXT]
