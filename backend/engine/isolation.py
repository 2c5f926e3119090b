"""After a failed step: find the sequence that caused it (isolate, probe) so that only it ends; the others carry on
with the same tokens (recompute is exact). `engine` is the LLMEngine (engine.py calls these; no import back)."""

from __future__ import annotations

import logging
from typing import Any

from edgeinfer.backend.engine.scheduler import Scheduler
from edgeinfer.backend.engine.sequence import SeqStatus, Sequence

log = logging.getLogger("edgeinfer.engine")


def isolate(engine: Any, error: Exception) -> None:
    """After a failed step: put every admitted sequence (and the queue, up to max_num_seqs) back to
    recompute, then run each alone until it yields a token. A sequence whose solo step fails is the
    culprit and ends with an error; the others carry on with the same tokens (recompute is exact).
    If every one of two or more fails alone, the node is at fault: they end with 503."""
    suspects = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    if not suspects:
        return
    for seq in suspects:
        engine.scheduler.remove(seq)          # frees its pages; the waiting queue is rebuilt below
        seq.num_computed_tokens = 0
        seq.page_hashes = []
        seq.status = SeqStatus.WAITING
    failed: list[tuple[Sequence, str]] = []
    rest = list(suspects)
    while rest and len(engine.scheduler.running) < engine.cfg.max_num_seqs:
        seq = rest.pop(0)
        outcome = probe(engine, seq)
        if outcome == "stuck":               # no room alone right now: queue it with the rest
            rest.insert(0, seq)
            break
        if outcome is not None:
            failed.append((seq, outcome))
    engine.scheduler.waiting.extendleft(reversed(rest))
    code = 503 if len(failed) == len(suspects) > 1 else 500
    for seq, msg in failed:
        engine.finish_error(seq, msg, code)
    if failed:
        log.warning("step failure isolated: %d of %d sequence(s) failed alone (%s): %s", len(failed),
                    len(suspects), ", ".join(s.request_id for s, _ in failed), error)

def probe(engine: Any, seq: Sequence) -> str | None:
    """Run seq alone until it has a new token or finishes. None: fine (it is running again or
    finished); "stuck": it could not be scheduled alone; otherwise the failure's message."""
    solo = Scheduler(engine.cfg, engine.blocks)
    solo.add(seq)
    main, engine.scheduler = engine.scheduler, solo
    produced = len(seq.output_ids)
    try:
        while seq.status != SeqStatus.FINISHED and len(seq.output_ids) == produced:
            computed = seq.num_computed_tokens
            engine.step()
            if seq.status != SeqStatus.FINISHED and seq.num_computed_tokens == computed \
                    and len(seq.output_ids) == produced:
                solo.remove(seq)
                seq.num_computed_tokens, seq.page_hashes, seq.status = 0, [], SeqStatus.WAITING
                return "stuck"
    except Exception as e:  # this sequence fails alone: it is the culprit
        log.exception("request %s fails alone", seq.request_id)
        solo.remove(seq)
        return f"engine step failed on this request: {type(e).__name__}: {e}"
    finally:
        engine.scheduler = main
        engine.flush()
    if seq.status != SeqStatus.FINISHED:
        main.running.append(seq)
    return None
