"""Client JSON Schemas checked against the meta-schema off the event loop, under a time budget, cached.

jsonschema is pure Python and holds the GIL: on the loop, 100,000 properties stalled every tenant's stream
and the node probes for 24.5 s (issue 39), and in a thread the loop would still share the CPU with it for
as long. Here the check runs in `workers` processes (spawned on the first schema the cache does not hold,
at a lower CPU priority, like the tokenizer workers); `structured.measure` has already bounded each schema
on the loop. A request's checks that are not done within `timeout_s` are a 400, and the workers are killed
and replaced, so a costly check does not go on burning a core. Results (valid or not) are cached by the
sha256 of the schema's compact JSON: an agent's tools, sent with every turn, are checked once.
With `workers` 0 the check runs in a thread (tests, tiny deployments; no kill on timeout).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import os
import signal
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import msgspec

from edgeinfer.gateway.errors import APIError
from edgeinfer.gateway.structured import Pending, Problem, raise_problem, schema_problem

log = logging.getLogger("edgeinfer.gateway")
_NICE = 5


def _init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the gateway's to handle: one line, no traceback
    try:
        os.nice(_NICE)
    except OSError:
        pass
    import jsonschema  # noqa: F401 - imported once per worker, not per check


def _check_all(items: list[tuple[bytes, str]]) -> list[Problem]:
    return [schema_problem(msgspec.json.decode(body), param) for body, param in items]


class SchemaGuard:
    def __init__(self, workers: int, timeout_s: float, cache_entries: int = 1024) -> None:
        self.workers = workers
        self.timeout_s = timeout_s
        self.cache_entries = cache_entries
        self._cache: OrderedDict[bytes, Problem] = OrderedDict()
        self._pool: ProcessPoolExecutor | None = None
        self.checks = 0        # schemas checked (not from the cache)
        self.timeouts = 0

    def _new(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init)

    async def check(self, pending: Pending) -> None:
        """APIError 400 naming the first bad schema's bad part, or 400 when the checks outrun the budget."""
        if not pending:
            return
        todo: list[tuple[bytes, bytes, str]] = []
        for schema, param in pending:
            body = msgspec.json.encode(schema)
            key = hashlib.sha256(param.encode() + b"\0" + body).digest()
            if key in self._cache:
                self._cache.move_to_end(key)
                raise_problem(self._cache[key])
            else:
                todo.append((key, body, param))
        if not todo:
            return
        problems = await self._run([(body, param) for _, body, param in todo])
        self.checks += len(todo)
        for (key, _, _), problem in zip(todo, problems):
            self._cache[key] = problem
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        for problem in problems:
            raise_problem(problem)

    async def _run(self, items: list[tuple[bytes, str]]) -> list[Problem]:
        if self.workers == 0:
            return await self._budget(asyncio.to_thread(_check_all, items), None, items[0][1])
        for attempt in range(2):
            if self._pool is None:
                self._pool = self._new()
            pool = self._pool
            try:
                return await self._budget(asyncio.wrap_future(pool.submit(_check_all, items)), pool, items[0][1])
            except BrokenProcessPool:      # another request's timeout killed the workers: once more on new ones
                if self._pool is pool:
                    self._pool = None
                if attempt:
                    raise APIError(503, "schema check workers failed; retry", code="schema_check_failed",
                                   headers={"retry-after": "1"}) from None
        raise AssertionError("unreachable")

    async def _budget(self, work, pool: ProcessPoolExecutor | None, param: str) -> list[Problem]:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await work
        except TimeoutError:
            self.timeouts += 1
            if pool is not None:
                self._kill(pool)
            raise APIError(400, f"the request's JSON schemas were not checked within {self.timeout_s:g} s "
                                "(server.schema_check_timeout_s): simplify them", code="schema_too_complex",
                           param=param) from None

    def _kill(self, pool: ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
        processes = list((getattr(pool, "_processes", None) or {}).values())
        log.warning("schema check over its %.1f s budget: killing %d worker(s)", self.timeout_s, len(processes))
        for p in processes:
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
