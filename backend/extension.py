"""What the backend server calls on the parts it is assembled with (the page store bridge with its hand-off):
`BackendState.extensions` holds them, and the server calls every hook on every one, in order (stopped in reverse);
no hook is looked up by name. A part that has nothing to do in a hook returns at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from edgeinfer.backend.page_store.handoff import KVHandoff
    from edgeinfer.protocol.wire import GenerateRequest


class ServerExtension(Protocol):
    handoff: KVHandoff | None   # the node-to-node page hand-off it serves on /internal/pages, if any

    async def start(self, app: web.Application) -> None: ...

    async def stop(self, app: web.Application) -> None: ...

    async def before_generate(self, app: web.Application, req: GenerateRequest) -> int | None:
        """Before a request is admitted (e.g. fetch, verify and upload its pages); returns pages uploaded or None."""
        ...

    async def on_drain(self, app: web.Application) -> None: ...

    async def on_undrain(self, app: web.Application) -> None: ...
