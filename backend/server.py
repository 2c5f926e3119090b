"""Backend HTTP server: assembles one node from its configuration (the model and engine, the KV format gate,
the page store and hand-off extensions, tracing) and runs backend/handlers.py's app on it (aiohttp + uvloop).
`python -m edgeinfer.backend.server` / `edgeinfer backend` start it."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

from aiohttp import web

from edgeinfer.backend.fault_injection import refuse_in_production
from edgeinfer.backend.handlers import STATE, BackendState, make_app  # noqa: F401  (the node's app, re-exported)
from edgeinfer.backend.metrics import BackendMetrics
from edgeinfer.backend.node_config import BackendConfig, parse_args
from edgeinfer.backend.quant import kv_gate
from edgeinfer.backend.quant.kv_gate import log_decision
from edgeinfer.backend.tracing import RequestTraces
from edgeinfer.telemetry import observability as obs

log = logging.getLogger("edgeinfer.backend")


def release_free_heap() -> int:
    """Give the heap the load left free (read buffers, unpacked weights) back to the OS: glibc keeps freed
    small-block memory mapped (measured ~27 MiB after loading the default model). Returns malloc_trim's result
    (1: memory released), -1 where there is no glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        return int(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return -1


def _kv_chooser(cfg: BackendConfig, out: list):
    """load_engine's kv_chooser: the measured gate's decision for this model (appended to `out`)."""
    def choose(model, tokenizer, model_dir: Path, fingerprint: str) -> str:
        d = kv_gate.decide(model, tokenizer, model_dir, fingerprint, cfg.kv_dtype, cfg.kv_kld_budget)
        out.append(d)
        return d.served
    return choose


def _decide_kv_for_dir(model_dir: Path, dtype, cfg: BackendConfig, out: list) -> str:
    from edgeinfer.backend.engine.loading import model_fingerprint
    from edgeinfer.backend.model.loader import load_model
    from edgeinfer.protocol.tokenizer import Tokenizer

    model = load_model(model_dir, dtype=dtype, device=cfg.device)
    tok = Tokenizer.from_dir(model_dir, model_vocab_size=model.cfg.vocab_size)
    return _kv_chooser(cfg, out)(model, tok, model_dir, model_fingerprint(model_dir))


def build_state(cfg: BackendConfig) -> BackendState:
    import torch

    from edgeinfer.backend.engine.loading import in_fresh_thread, load_engine
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model

    # the import runs torch on CPU: off the main thread, so the engine thread's OpenMP pool stays the only one
    model_dir = Path(cfg.model) if cfg.model else in_fresh_thread(ensure_native_default_model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    node = None
    gate: list[kv_gate.GateDecision] = []
    if cfg.tensor_parallel > 1:
        if cfg.device != "cpu":
            raise ValueError(f"--tensor-parallel {cfg.tensor_parallel} runs on the CPU (gloo) here; got --device "
                             f"{cfg.device}")
        from edgeinfer.backend.parallel.node import load_parallel_engine

        # the gate measures in this process on its own load of the model (a first start only: then the cache)
        kv = in_fresh_thread(_decide_kv_for_dir, model_dir, dtype, cfg, gate)
        engine, node = load_parallel_engine(model_dir, replace(cfg.engine_config(), kv_dtype=kv),
                                            cfg.tensor_parallel, cfg.expert_parallel, cfg.dtype, cfg.model_name)
    else:
        if cfg.expert_parallel:
            raise ValueError("--expert-parallel needs --tensor-parallel N with N > 1")
        engine = load_engine(model_dir, cfg.engine_config(), dtype=dtype, device=cfg.device,
                             model_name=cfg.model_name, kv_chooser=_kv_chooser(cfg, gate))
    release_free_heap()
    if gate:
        log_decision(gate[0], engine.model_name)
    node_id = cfg.node_id or f"{socket.gethostname()}-{cfg.port}-{uuid.uuid4().hex[:6]}"
    m = BackendMetrics(engine.model_name)
    engine.observers.append(m)
    m.set_memory(engine)
    st = BackendState(engine=engine, metrics=m, node_id=node_id, kv_gate=gate[0].report() if gate else None, version=cfg.version, parallel_node=node,
                      operator_key=cfg.operator_key, internal_secret=cfg.internal_secret,
                      url=(cfg.advertise_url or f"http://{cfg.host}:{cfg.port}").rstrip("/"),
                      keepalive_s=cfg.keepalive_s or None, max_queue_wait_s=cfg.max_queue_wait_s or None,
                      state="draining" if cfg.start_drained else "active", role=cfg.role)
    log.info(json.dumps({"event": "memory", "model": engine.model_name, "weight_bytes": engine.model.weight_bytes(),
                         "prepacked_copy_bytes": engine.model.prepacked_copy_bytes(),
                         "kv_dtype": engine.kv_format, "kv_bytes_per_token": engine.runner.bytes_per_token,
                         "kv_pages": engine.blocks.num_pages, "page_size": engine.cfg.page_size,
                         "max_tokens_in_budget": engine.blocks.num_pages * engine.cfg.page_size}))
    if obs.tracing_on():
        enable_tracing(st)
    from edgeinfer.backend.page_store.wiring import attach_page_store  # noqa: PLC0415

    attach_page_store(st, cfg)
    return st


def enable_tracing(st: BackendState) -> None:
    """Per-request spans and integrity-failure spans for this node (backend/tracing.py); tracing must be set up."""
    st.traces = RequestTraces(st.node_id)
    st.engine.observers.append(st.traces)
    st.engine.blocks.ledger.listeners.append(st.traces.integrity_failure)


def main(argv: list[str] | None = None) -> int:
    refuse_in_production()
    cfg = parse_args(argv)
    obs.configure_logging(cfg.log_format, cfg.log_level)
    try:
        obs.setup_tracing("edgeinfer-backend", cfg.otlp_endpoint)
    except RuntimeError as e:
        print(f"edgeinfer backend: error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if cfg.internal_secret is None:
        log.warning("--insecure-no-internal-auth: /internal/* answers anyone who can connect to %s:%d",
                    cfg.host, cfg.port)
    try:
        st = build_state(cfg)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"edgeinfer backend: error: {e}", file=sys.stderr)
        return 1
    app = make_app(st)

    async def serve() -> None:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
        await site.start()
        print(json.dumps({"event": "ready", "node_id": st.node_id, "url": st.url, "model": st.engine.model_name}),
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        st.state = "draining"
        deadline = time.monotonic() + 30
        while st.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await runner.cleanup()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
