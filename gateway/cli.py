"""`edgeinfer gateway ...` and `edgeinfer serve`.

  edgeinfer gateway [--config FILE] [--host H] [--port P] [--backend URL ...] [--model NAME=TOKENIZER_DIR]
  edgeinfer gateway hash-key KEY        print the sha256 to put in a tenant's api_key_sha256

(`edgeinfer serve`, the gateway with a local backend and valkey, is ops/serve.py: it runs serve_gateway.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

import msgspec

from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.config import GatewayConfig, NodeConfig, ServedModelConfig
from edgeinfer.telemetry import observability as obs

log = logging.getLogger("edgeinfer.gateway")


def setup_logging(fmt: str | None = None) -> None:
    """Logs to stderr: the access log's JSON lines and the rest as plain messages, or everything as JSON lines
    (`fmt` "json", else EDGEINFER_LOG_FORMAT)."""
    level = os.environ.get("EDGEINFER_LOG_LEVEL", "INFO")
    if level.upper() not in obs.LOG_LEVELS:
        raise ValueError(f"EDGEINFER_LOG_LEVEL={level!r}: expected one of {', '.join(obs.LOG_LEVELS)}")
    env_fmt = os.environ.get("EDGEINFER_LOG_FORMAT", "text")
    if env_fmt not in obs.LOG_FORMATS:      # refused even where --log-format wins: a bad setting is not ignored
        raise ValueError(f"EDGEINFER_LOG_FORMAT={env_fmt!r}: expected one of {', '.join(obs.LOG_FORMATS)}")
    obs.configure_logging(fmt or env_fmt, level, text_format="%(message)s")


async def serve_gateway(cfg: GatewayConfig, ready_line: str | None = None) -> None:
    from aiohttp import web

    from edgeinfer.gateway.app import GatewayRunner, create_app
    from edgeinfer.gateway.state import STATE

    app = create_app(cfg)
    s = cfg.server
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=s.shutdown_grace_s,
                           keepalive_timeout=s.keepalive_timeout_s)
    await runner.setup()
    _settle_gc()
    site = web.TCPSite(runner, s.host, s.port, backlog=4096)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    def reload() -> None:
        try:
            app[STATE].reload_tenants()
        except config_mod.ConfigError as e:
            log.error("SIGHUP reload failed, keeping the current tenants: %s", e)

    loop.add_signal_handler(signal.SIGHUP, reload)
    print(f"edgeinfer gateway listening on http://{s.host}:{s.port}", flush=True)
    if ready_line:
        print(ready_line, flush=True)
    await stop.wait()
    print("edgeinfer gateway: shutting down, letting running streams finish", flush=True)
    await runner.cleanup()


def _settle_gc() -> None:
    """Startup objects (tokenizer, templates, metrics, imports) go to the permanent generation, so the
    cycle collector stops re-scanning them; requests allocate short-lived cycles (aiohttp, asyncio), so
    young collections run less often."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def run_loop(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def load_config(path: str | None) -> GatewayConfig:
    return config_mod.load(path or config_mod.DEFAULT_CONFIG)


def with_env(cfg: GatewayConfig) -> GatewayConfig:
    """EDGEINFER_REDIS_URL (the backends' variable too: a URL with a password stays out of config files and argv)
    and EDGEINFER_REDIS_CLUSTER=1 over the config's redis_url / redis_cluster."""
    url = os.environ.get("EDGEINFER_REDIS_URL")
    cluster = os.environ.get("EDGEINFER_REDIS_CLUSTER", "").lower()
    if cluster not in ("", "0", "1", "true", "false"):
        raise config_mod.ConfigError(f"EDGEINFER_REDIS_CLUSTER={cluster!r}: expected 1 or 0")
    changes: dict = {}
    if url:
        changes["redis_url"] = url
    if cluster:
        changes["redis_cluster"] = cluster in ("1", "true")
    return msgspec.structs.replace(cfg, server=msgspec.structs.replace(cfg.server, **changes)) if changes else cfg


def _gateway(argv: list[str]) -> int:
    if argv[:1] == ["hash-key"]:
        if len(argv) != 2:
            print("usage: edgeinfer gateway hash-key KEY", file=sys.stderr)
            return 2
        print(config_mod.hash_key(argv[1]))
        return 0
    p = argparse.ArgumentParser(prog="edgeinfer gateway")
    p.add_argument("--config", help="TOML config (default: the built-in gateway/default_config.toml)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--backend", action="append", default=[], help="static backend URL (repeatable)")
    p.add_argument("--model", action="append", default=[], help="NAME=TOKENIZER_DIR (repeatable)")
    p.add_argument("--log-format", choices=list(obs.LOG_FORMATS), default=None,
                   help="json: every log line a JSON object (the access log always is); default EDGEINFER_LOG_FORMAT "
                        "or text")
    p.add_argument("--otlp-endpoint", default=None,
                   help="send OpenTelemetry traces to this OTLP/HTTP collector (else OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "neither: no tracing)")
    args = p.parse_args(argv)
    try:
        cfg = with_env(load_config(args.config))
        cfg = override(cfg, args.host, args.port, args.model, args.backend)
        config_mod.check_secrets(cfg)
    except config_mod.ConfigError as e:
        print(f"edgeinfer gateway: error: {e}", file=sys.stderr)
        return 2
    try:
        setup_logging(args.log_format)
        obs.setup_tracing("edgeinfer-gateway", args.otlp_endpoint)
    except (RuntimeError, ValueError) as e:
        print(f"edgeinfer gateway: error: {e}", file=sys.stderr)
        return 2
    run_loop(serve_gateway(cfg))
    return 0


def override(cfg: GatewayConfig, host: str | None, port: int | None, models: list[str],
              backends: list[str]) -> GatewayConfig:
    server = msgspec.structs.replace(cfg.server, **{k: v for k, v in (("host", host), ("port", port)) if v})
    extra = []
    for spec in models:
        name, sep, tok = spec.partition("=")
        if not sep:
            raise config_mod.ConfigError(f"--model {spec!r}: expected NAME=TOKENIZER_DIR")
        extra.append(ServedModelConfig(name, tok))
    all_models = [*cfg.models, *extra]
    nodes = list(cfg.nodes)
    for i, url in enumerate(backends):
        info = backend_info(url, timeout_s=10, headers=cfg.internal_auth)
        if info["model"] not in {m.name for m in all_models}:
            raise config_mod.ConfigError(f"backend {url} serves {info['model']!r}: add --model "
                                         f"{info['model']}=TOKENIZER_DIR")
        nodes.append(NodeConfig(info.get("node_id") or f"backend-{i}", url, info["model"]))
    data = msgspec.to_builtins(msgspec.structs.replace(cfg, server=server, models=all_models, nodes=nodes))
    return config_mod.parse(data, cfg.source)


def backend_info(url: str, timeout_s: float, headers: dict[str, str]) -> dict:
    deadline = time.monotonic() + timeout_s
    req = urllib.request.Request(url.rstrip("/") + "/internal/info", headers=headers)
    while True:
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return msgspec.json.decode(r.read())
        except OSError as e:
            if isinstance(e, urllib.error.HTTPError) and e.code == 401:
                raise config_mod.ConfigError(f"backend {url} refused this gateway's internal secret (401): give "
                                             "both the same one (server.internal_secret_env, by default "
                                             "EDGEINFER_INTERNAL_SECRET)") from e
            if time.monotonic() > deadline:
                raise config_mod.ConfigError(f"backend {url} did not answer /internal/info: {e}") from e
            time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: str, argv: list[str]) -> int:
    return _gateway(argv)
