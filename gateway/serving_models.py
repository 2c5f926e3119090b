"""GET /v1/models: the served models this tenant may use."""

from __future__ import annotations

from aiohttp import web

from edgeinfer.gateway.schemas import (
    ModelCard,
    ModelList,
    encode,
)
from edgeinfer.gateway.state import STATE


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    tenant = st.authenticate(request)
    cards = [ModelCard(name, st.started) for name in sorted(st.models) if tenant.allows(name)]
    return web.Response(body=encode(ModelList(cards)), content_type="application/json")
