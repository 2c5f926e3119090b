"""The real backend app (backend.server.make_app) served in-process on a free loopback port, for tests that
talk to it over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from edgeinfer.backend.server import BackendState, make_app


@asynccontextmanager
async def serve(st: BackendState) -> AsyncIterator[aiohttp.ClientSession]:
    """Serve `st` on 127.0.0.1 (a free port) and yield a client session based at its URL; cleans up both."""
    runner = web.AppRunner(make_app(st), handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield http
    finally:
        await runner.cleanup()
