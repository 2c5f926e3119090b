"""`edgeinfer gateway ...` and `edgeinfer serve`.

  edgeinfer gateway [--config FILE] [--host H] [--port P] [--backend URL ...] [--model NAME=TOKENIZER_DIR]
  edgeinfer gateway hash-key KEY        print the sha256 to put in a tenant's api_key_sha256
  edgeinfer serve [--port P] [--model DIR] [--config FILE]
                                        gateway + one local backend + the default model, single node
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec

from gateway import config as config_mod
from gateway.config import GatewayConfig, ModelConfig, NodeConfig

log = logging.getLogger("edgeinfer.gateway")


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("EDGEINFER_LOG_LEVEL", "INFO"), format="%(message)s",
                        stream=sys.stderr)


async def serve_gateway(cfg: GatewayConfig, ready_line: str | None = None) -> None:
    from aiohttp import web

    from gateway.app import GatewayRunner, create_app
    from gateway.state import STATE

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


def _run(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def _load(path: str | None) -> GatewayConfig:
    return config_mod.load(path or config_mod.DEFAULT_CONFIG)


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
    args = p.parse_args(argv)
    try:
        cfg = _load(args.config)
        cfg = _override(cfg, args.host, args.port, args.model, args.backend)
    except config_mod.ConfigError as e:
        print(f"edgeinfer gateway: error: {e}", file=sys.stderr)
        return 2
    _setup_logging()
    _run(serve_gateway(cfg))
    return 0


def _override(cfg: GatewayConfig, host: str | None, port: int | None, models: list[str],
              backends: list[str]) -> GatewayConfig:
    server = msgspec.structs.replace(cfg.server, **{k: v for k, v in (("host", host), ("port", port)) if v})
    extra = []
    for spec in models:
        name, sep, tok = spec.partition("=")
        if not sep:
            raise config_mod.ConfigError(f"--model {spec!r}: expected NAME=TOKENIZER_DIR")
        extra.append(ModelConfig(name, tok))
    all_models = [*cfg.models, *extra]
    nodes = list(cfg.nodes)
    for i, url in enumerate(backends):
        info = _backend_info(url, timeout_s=10, headers=cfg.internal_auth)
        if info["model"] not in {m.name for m in all_models}:
            raise config_mod.ConfigError(f"backend {url} serves {info['model']!r}: add --model "
                                         f"{info['model']}=TOKENIZER_DIR")
        nodes.append(NodeConfig(info.get("node_id") or f"backend-{i}", url, info["model"]))
    data = msgspec.to_builtins(msgspec.structs.replace(cfg, server=server, models=all_models, nodes=nodes))
    return config_mod.parse(data, cfg.source)


def _backend_info(url: str, timeout_s: float, headers: dict[str, str]) -> dict:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"backend exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"backend at {url} not ready after {timeout_s:.0f}s")


def _serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="edgeinfer serve")
    p.add_argument("--config", help="gateway TOML (default: built-in, with the demo tenant)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct, imported on first use)")
    p.add_argument("--backend-port", type=int, default=0)
    p.add_argument("--backend-arg", action="append", default=[], help="extra flag for backend.server (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    _setup_logging()
    try:
        cfg = _load(args.config)
    except config_mod.ConfigError as e:
        print(f"edgeinfer serve: error: {e}", file=sys.stderr)
        return 2
    if args.model:
        model_dir = Path(args.model)
    else:
        from backend.model.gguf_import import ensure_native_default_model

        print("edgeinfer serve: preparing the default model (first run imports the GGUF, INT4 kept)", flush=True)
        model_dir = ensure_native_default_model()
    port = args.backend_port or _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "backend.server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--node-id", "local-0", *args.backend_arg]
    env = dict(os.environ)
    if not env.get(cfg.server.page_seed_env):  # a fresh secret shared by this machine's gateway and backend
        env[cfg.server.page_seed_env] = os.urandom(16).hex()
        os.environ[cfg.server.page_seed_env] = env[cfg.server.page_seed_env]
    secret_env = cfg.server.internal_secret_env
    if not env.get(secret_env):   # the backend reads only the env var; a fresh one unless the config has one
        env[secret_env] = cfg.server.internal_secret or secrets.token_hex(32)
        os.environ[secret_env] = env[secret_env]
    print(f"edgeinfer serve: starting backend: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env)
    try:
        _wait_ready(proc, url, args.ready_timeout)
        info = _backend_info(url, timeout_s=10, headers=cfg.internal_auth)
        cfg = _override(cfg, args.host, args.port, [f"{info['model']}={model_dir}"], [])
        cfg = config_mod.parse({**msgspec.to_builtins(cfg),
                                "nodes": [{"id": info.get("node_id") or "local-0", "url": url,
                                           "model": info["model"]}]}, cfg.source)
        s = cfg.server
        _run(serve_gateway(cfg, ready_line=f"edgeinfer serve: ready: http://{s.host}:{s.port}/v1 "
                                            f"model={info['model']} (demo key: {config_mod.DEMO_API_KEY})"))
    except (RuntimeError, config_mod.ConfigError) as e:
        print(f"edgeinfer serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 0


def run(cmd: str, argv: list[str]) -> int:
    if cmd == "serve":
        return _serve(argv)
    return _gateway(argv)
