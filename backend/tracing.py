"""The backend's spans (telemetry/observability.py): per request, `backend.generate` (the caller's trace, from its
`traceparent`) with children `backend.kv_fetch` (made in backend/server.py), and `backend.queue` (arrival to
first admission), `backend.prefill` (admission to the first token), `backend.decode` (first token to the end),
recorded after the fact from the sequence's own times (the engine thread keeps no trace context); and a
`backend.kv_integrity_failure` span per failure the page ledger records (its own trace: found on the engine thread,
where no request's context is)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from edgeinfer.backend.engine.observer import EngineObserver
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.telemetry import observability as obs

KEEP = 10_000     # finished requests' times kept for their handlers (a handler pops its own)


class RequestTraces(EngineObserver):
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._done: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def on_finish(self, seq: Sequence) -> None:      # engine thread
        rec = (seq.arrival, seq.admitted_at, seq.first_token_time, time.monotonic(), len(seq.prompt_ids),
               seq.num_cached_prompt_tokens, len(seq.output_ids), seq.finish_reason)
        with self._lock:
            self._done[seq.request_id] = rec
            while len(self._done) > KEEP:
                self._done.popitem(last=False)

    def spans_for(self, request_id: str, parent) -> None:
        """The finished request's queue / prefill / decode spans under the current span `parent`."""
        with self._lock:
            rec = self._done.pop(request_id, None)
        if rec is None:
            return
        arrival, admitted, first, end, prompt, cached, out, reason = rec
        parent.set_attributes({"edgeinfer.cached_tokens": cached, "edgeinfer.completion_tokens": out,
                               "edgeinfer.finish_reason": reason or ""})
        if admitted is None:
            obs.past_span("backend.queue", arrival, end, {"edgeinfer.admitted": False})
            return
        obs.past_span("backend.queue", arrival, admitted)
        obs.past_span("backend.prefill", admitted, first if first is not None else end,
                      {"edgeinfer.prompt_tokens": prompt, "edgeinfer.cached_tokens": cached})
        if first is not None:
            obs.past_span("backend.decode", first, end, {"edgeinfer.completion_tokens": out})

    def integrity_failure(self, where: str, detail: str) -> None:   # engine thread (PageLedger.listeners)
        with obs.span("backend.kv_integrity_failure", {"edgeinfer.node": self.node_id, "edgeinfer.where": where,
                                                       "edgeinfer.detail": detail}):
            pass
