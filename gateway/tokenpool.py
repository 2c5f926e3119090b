"""Long prompts are tokenized in worker processes, so a huge prompt cannot stall the event loop.

Measured (docs/GATEWAY.md, "Limits"): `tokenizers`' Tokenizer.encode holds the GIL for the whole encode (a
3.9 MB prompt: 3-12 s), so a thread does not let the loop run; encode_batch releases it but building the
Python result still holds it ~0.4 s. The workers load every model's tokenizer in their initializer, run at
a lower CPU priority (the loop wins the CPU) and send the ids back packed as int32, so the loop does no
per-token work until the prompt has passed the length checks. Workers start on the first long prompt.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

log = logging.getLogger("edgeinfer.gateway")
_NICE = 5
_models: dict = {}     # in a worker: model name -> PromptEncoder


class WorkerFailed(Exception):
    """What the worker raised, carried back as text (`tokenizer`: a TokenizerError, else a template error)."""

    def __init__(self, tokenizer: bool, message: str) -> None:
        super().__init__(tokenizer, message)
        self.tokenizer = tokenizer
        self.message = message


def _init(sources: dict[str, str]) -> None:
    from edgeinfer.gateway.prompt_ids import PromptEncoder
    from edgeinfer.protocol.tokenizer import Tokenizer

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the gateway's to handle: one line, no traceback
    try:
        os.nice(_NICE)
    except OSError:
        pass
    for name, source in sources.items():
        _models[name] = PromptEncoder(Tokenizer.from_dir(source))


def _encode(name: str, kind: str, payload) -> bytes | WorkerFailed:
    from edgeinfer.protocol.tokenizer import TokenizerError

    model = _models[name]
    try:
        ids = (model.chat_ids(payload) if kind == "chat" else model.text_ids(payload) if kind == "text"
               else model.prompt_ids(payload))
    except TokenizerError as e:
        return WorkerFailed(True, str(e))
    except Exception as e:  # jinja2 TemplateError and the like: not always picklable, so sent as text
        return WorkerFailed(False, f"{type(e).__name__}: {e}")
    return array("i", ids).tobytes()


class TokenizerPool:
    def __init__(self, sources: dict[str, str], workers: int) -> None:
        self.sources = sources
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None   # made on first use: even idle, it starts a resource tracker

    def _new(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init, initargs=(self.sources,))

    def serves(self, name: str) -> bool:
        return name in self.sources

    async def encode(self, name: str, kind: str, payload) -> array:
        """Token ids (int32). Raises WorkerFailed, or BrokenProcessPool if a worker died (the pool is
        replaced for the next request)."""
        if self._pool is None:
            self._pool = self._new()
        pool = self._pool
        try:
            out = await asyncio.wrap_future(pool.submit(_encode, name, kind, payload))
        except BrokenProcessPool:
            if self._pool is pool:
                log.error("a tokenizer worker died; starting new ones")
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new()
            raise
        if isinstance(out, WorkerFailed):
            raise out
        ids = array("i")
        ids.frombytes(out)
        return ids

    def close(self) -> None:
        """Queued work is dropped; a worker busy with a prompt exits when it is done."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
