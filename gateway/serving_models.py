"""GET /v1/models: the served models this tenant may use; GET /v1/models/{id}: one of them (the openai SDK's
models.retrieve), else a 404 naming it, the same for a model that does not exist and one the tenant may not use."""

from __future__ import annotations

from aiohttp import web

from edgeinfer.gateway.errors import APIError
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


async def retrieve_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    tenant = st.authenticate(request)
    name = request.match_info["model"]
    if name not in st.models or not tenant.allows(name):
        raise APIError(404, f"The model '{name}' does not exist or you do not have access to it.",
                       code="model_not_found", param="model")
    return web.Response(body=encode(ModelCard(name, st.started)), content_type="application/json")
