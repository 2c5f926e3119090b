"""One generate stream to one backend over the shared ClientSession (NDJSON of StreamChunk).

Failures before the first chunk raise Retryable (the caller tries another node); after it they
raise UpstreamBroken. Closing a stream that did not finish drops the connection (which aborts on
the backend) and also POSTs /internal/abort, in case the backend still holds the request.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec

from backend.protocol import AbortRequest, GenerateRequest, StreamChunk, chunk_decoder
from gateway.nodes import Node

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_JSON = {"content-type": "application/json"}


class Retryable(Exception):
    """The node failed before sending anything for this request: safe to try another node."""


class UpstreamBroken(Exception):
    """The node failed after the first chunk: the request cannot be moved."""


class BackendRejected(Exception):
    """The backend answered the request with an error chunk (e.g. 400 prompt too long)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UpstreamStream:
    def __init__(self, node: Node, request_id: str, resp: aiohttp.ClientResponse, chunk_timeout_s: float,
                 aborter) -> None:
        self.node = node
        self.request_id = request_id
        self._resp = resp
        self._chunk_timeout = chunk_timeout_s
        self._aborter = aborter
        self.finished = False

    async def next(self) -> StreamChunk | None:
        try:
            async with asyncio.timeout(self._chunk_timeout):
                line = await self._resp.content.readline()
                while line == b"\n":
                    line = await self._resp.content.readline()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise UpstreamBroken(f"node {self.node.node_id}: stream failed: {type(e).__name__}: {e}") from e
        if not line:
            return None
        try:
            chunk = chunk_decoder.decode(line)
        except msgspec.DecodeError as e:
            raise UpstreamBroken(f"node {self.node.node_id}: malformed chunk: {e}") from e
        if chunk.finish_reason is not None or chunk.error is not None:
            self.finished = True
        return chunk

    def close(self) -> None:
        """Release the connection; abort on the backend if the stream did not end normally."""
        if self.finished:
            self._resp.release()
            return
        self._resp.close()
        self._aborter(self.node, self.request_id)


class Upstream:
    def __init__(self, session_getter, connect_timeout_s: float, first_byte_timeout_s: float,
                 chunk_timeout_s: float) -> None:
        self._session = session_getter
        self.first_byte_timeout_s = first_byte_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._aborts: set[asyncio.Task] = set()

    async def open(self, node: Node, req: GenerateRequest) -> tuple[UpstreamStream, StreamChunk]:
        """POST the request and read its first chunk; Retryable if that fails."""
        session: aiohttp.ClientSession = self._session()
        resp = None
        try:
            async with asyncio.timeout(self.first_byte_timeout_s):
                resp = await session.post(node.generate_url, data=_encode(req), headers=_JSON,
                                          timeout=self._timeout)
                if resp.status != 200:
                    body = (await resp.read())[:300].decode(errors="replace")
                    resp.release()
                    if resp.status in (400, 413, 422):
                        raise BackendRejected(400, f"backend rejected the request: {body}")
                    raise Retryable(f"node {node.node_id}: HTTP {resp.status}: {body}")
                stream = UpstreamStream(node, req.request_id, resp, self.chunk_timeout_s, self.abort)
                first = await stream.next()
        except (TimeoutError, aiohttp.ClientError, OSError, UpstreamBroken) as e:
            if resp is not None:
                resp.close()
                self.abort(node, req.request_id)
            raise Retryable(f"node {node.node_id}: {type(e).__name__}: {e}") from e
        except BaseException:
            if resp is not None:
                resp.close()
                self.abort(node, req.request_id)
            raise
        if first is None:
            resp.close()
            raise Retryable(f"node {node.node_id}: stream ended before the first chunk")
        if first.error is not None and not first.token_ids:
            stream.finished = True
            resp.release()
            code = first.error_code or 500
            if code in (400, 413, 422):
                raise BackendRejected(400, first.error)
            raise Retryable(f"node {node.node_id}: {code}: {first.error}")
        return stream, first

    def abort(self, node: Node, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._post_abort(node, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _post_abort(self, node: Node, request_id: str) -> None:
        session: aiohttp.ClientSession = self._session()
        try:
            async with session.post(node.abort_url, data=_encode(AbortRequest(request_id)), headers=_JSON,
                                    timeout=aiohttp.ClientTimeout(total=5)) as r:
                await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.info("abort of %s on node %s failed: %s", request_id, node.node_id, e)

    async def drain_aborts(self) -> None:
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=5)
