"""Run an aiohttp app on a real loopback port in a thread with its own event loop."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class ServerThread:
    def __init__(self, make_app, shutdown_timeout: float = 5.0, runner_cls: type[web.AppRunner] = web.AppRunner) -> None:
        self._make_app = make_app
        self._runner_cls = runner_cls
        self._shutdown_timeout = shutdown_timeout
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.app = self._make_app()
        self._runner = self._runner_cls(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self._shutdown_timeout)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def start(self) -> ServerThread:
        self._thread.start()
        self.call(self._start())
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._runner is not None:
            self.call(self._runner.cleanup(), timeout)
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
