"""One generate stream to one backend over gateway.http1's keep-alive pool (NDJSON of StreamChunk).

Failures before the first chunk raise Retryable (the caller tries another node), and so does the
node ceasing to answer its health probes during that wait; after it they raise UpstreamBroken.
A backend keepalive (an empty line, sent while its engine steps but this request has nothing yet: queued
or prefilling) restarts the first-byte or chunk timer: the timers measure silence, not queueing, so a busy
node that works through its queue is waited for, and a stuck one (no steps, no keepalives) still times out.
A 503 carrying Retry-After is the backend refusing a request its queue would hold too long: Overloaded
(another node may take it; the node is not marked down).
Closing a stream that did not finish drops the connection (which aborts on the backend) and also
POSTs /internal/abort, in case the backend still holds the request.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from edgeinfer.gateway.http1 import HTTPProtocolError, Pool, Response
from edgeinfer.gateway.nodes import Node
from edgeinfer.protocol.wire import AbortRequest, GenerateRequest, StreamChunk, chunk_decoder
from edgeinfer.telemetry import observability as obs

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_FAILURES = (TimeoutError, OSError, HTTPProtocolError)   # ConnectionDropped is an OSError


class Retryable(Exception):
    """The node failed before sending anything for this request: safe to try another node."""


class Overloaded(Retryable):
    """The node refused the request: its estimated queue wait is over its bound. Not a failure of the node."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamBroken(Exception):
    """The node failed after the first chunk: the request cannot be moved."""


GRAMMAR_FAILED = "invalid_grammar"    # the request's own constraint hit a parser limit (backend error_code 422)


def error_code_name(status: int | None) -> str:
    """The OpenAI-style code of a backend error chunk's status."""
    return GRAMMAR_FAILED if status == 422 else "invalid_request" if status in (400, 413) else "backend_error"


class BackendRejected(Exception):
    """The backend answered the request with an error the request caused (e.g. 400 prompt too long, 500 it
    failed alone on a healthy node): not retried on another node, the node is not marked down."""

    def __init__(self, status: int, message: str, code: str = "backend_rejected") -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    @property
    def grammar(self) -> bool:
        return self.code == GRAMMAR_FAILED


class UpstreamStream:
    def __init__(self, node: Node, request_id: str, resp: Response, chunk_timeout_s: float, aborter,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.node = node
        self.request_id = request_id
        self._resp = resp
        self._chunk_timeout = chunk_timeout_s
        self._aborter = aborter
        self._loop = loop
        self.finished = False

    async def next(self) -> StreamChunk | None:
        try:
            line = await self._resp.readline(self._loop.time() + self._chunk_timeout)
            while line == b"\n":   # keepalive: the node's engine is stepping
                line = await self._resp.readline(self._loop.time() + self._chunk_timeout)
        except _FAILURES as e:
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

    def ready(self) -> bool:
        """next() would return without waiting (the backend sent faster than we relayed)."""
        return not self.finished and self._resp.has_line()

    def close(self) -> None:
        """Release the connection; abort on the backend if the stream did not end normally."""
        if self.finished:
            self._resp.release()
            return
        self._resp.close()
        self._aborter(self.node, self.request_id)


def _retry_after(headers: dict[str, str]) -> int | None:
    try:
        return max(0, int(headers["retry-after"]))
    except (KeyError, ValueError):
        return None


class Upstream:
    def __init__(self, connect_timeout_s: float, first_byte_timeout_s: float, chunk_timeout_s: float,
                 headers: dict[str, str] | None = None) -> None:
        self.pool = Pool(connect_timeout_s, headers=headers)   # headers: the internal secret (config.internal_auth)
        self.first_byte_timeout_s = first_byte_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self._aborts: set[asyncio.Task] = set()

    async def open(self, node: Node, req: GenerateRequest) -> tuple[UpstreamStream, StreamChunk]:
        """POST the request and read its first chunk; Retryable if that fails, or as soon as the node
        stops answering its health probes while we wait (a hung node still accepts the connection)."""
        try:
            async with asyncio.timeout(None) as watch:   # expired by NodePool when a probe goes unanswered
                node.watchers.add(watch)
                try:
                    return await self._open(node, req)
                finally:
                    node.watchers.discard(watch)
        except TimeoutError as e:   # _open turns its own timeouts into Retryable: this is the watch
            raise Retryable(f"node {node.node_id}: stopped answering its health probes while the request "
                            f"waited for its first byte") from e

    async def _open(self, node: Node, req: GenerateRequest) -> tuple[UpstreamStream, StreamChunk]:
        loop = asyncio.get_running_loop()
        wait = self.first_byte_timeout_s
        deadline = loop.time() + wait
        resp: Response | None = None
        try:
            trace = b""
            if obs.tracing_on():   # W3C traceparent: the backend's spans join this request's trace
                trace = b"".join(f"{k}: {v}\r\n".encode() for k, v in obs.inject_headers({}).items())
            resp = await self.pool.post(node.generate_url, _encode(req), deadline, trace)
            if resp.status != 200:
                body = (await resp.read(deadline, limit=300)).decode(errors="replace")
                refused, resp = resp, None      # nothing runs on the node: no abort to send
                refused.release()
                if refused.status in (400, 413, 422):
                    raise BackendRejected(400, f"backend rejected the request: {body}")
                if refused.status == 503 and (retry := _retry_after(refused.headers)) is not None:
                    raise Overloaded(f"node {node.node_id}: HTTP 503: {body}", retry)
                raise Retryable(f"node {node.node_id}: HTTP {refused.status}: {body}")
            stream = UpstreamStream(node, req.request_id, resp, self.chunk_timeout_s, self.abort, loop)
            line = await resp.readline(deadline)
            while line == b"\n":   # keepalive: queued or prefilling on a node whose engine steps
                line = await resp.readline(loop.time() + wait)
            first = chunk_decoder.decode(line) if line else None
        except (*_FAILURES, msgspec.DecodeError) as e:
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
        if first.finish_reason is not None or first.error is not None:
            stream.finished = True
        if first.error is not None and not first.token_ids:
            resp.release()
            code = first.error_code or 500
            if code == 500:     # the engine isolated the failure to this request: another node would repeat it
                raise BackendRejected(500, f"generation failed on node {node.node_id}: {first.error}",
                                      code="generation_failed")
            if code in (400, 413, 422):
                raise BackendRejected(400, first.error, error_code_name(code))
            raise Retryable(f"node {node.node_id}: {code}: {first.error}")
        return stream, first

    def abort(self, node: Node, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._post_abort(node, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _post_abort(self, node: Node, request_id: str) -> None:
        deadline = asyncio.get_running_loop().time() + 5.0
        try:
            resp = await self.pool.post(node.abort_url, _encode(AbortRequest(request_id)), deadline)
            await resp.read(deadline, limit=4096)
            resp.release()
        except _FAILURES as e:
            log.info("abort of %s on node %s failed: %s", request_id, node.node_id, e)

    async def drain_aborts(self) -> None:
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=5)

    def close(self) -> None:
        self.pool.close()
