"""`edgeinfer serve`: the whole product on one machine: an embedded valkey (page store, prefix index, node
registry), one backend on the default model (or --model DIR) and the gateway in this process.

  edgeinfer serve [--port P] [--model DIR] [--config FILE] [--redis-url URL | --no-page-store]
                  [--nodes N | --prefill-nodes N --decode-nodes M]

With --prefill-nodes N --decode-nodes M it starts N backends with --role prefill and M with --role decode (prefill/
decode disaggregation, docs/DISAGGREGATION.md) instead of one with --role both; the gateway routes in two hops.

Order: the gateway's port is checked before anything loads (a port in use is one line, exit 2); valkey
starts; the default model is imported on the first run (a progress bar); the backend starts (the first
start compiles the CPU kernels; progress lines meanwhile); then the gateway serves. Every child is stopped
by its pid on exit, Ctrl-C or SIGTERM, also during the first start (ops/children.py).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec

from edgeinfer.backend.fault_injection import refuse_in_production
from edgeinfer.ops.children import Children, Stopped, exit_code, raise_on_stop_signals
from edgeinfer.ops.local_state import HomeLock, LocalSecrets, clear_running, write_running
from edgeinfer.ops.local_valkey import MAXMEMORY, LocalValkey, ValkeyError
from edgeinfer.protocol.defaults import BACKEND_OPTIONS, env_defaults, home_dir, named
from edgeinfer.telemetry import observability as obs

PAGE_KEY_ENV = "EDGEINFER_PAGE_KEY"     # what backend.server reads (backend/page_store/wiring.py)
REDIS_URL_ENV = "EDGEINFER_REDIS_URL"   # backend.server's --redis-url default
PROGRESS_EVERY_S = 15.0


_JSON_LINES = False    # --log-format json: serve's own lines are JSON objects too


def say(msg: str) -> None:
    if _JSON_LINES:
        print(json.dumps({"ts": round(time.time(), 3), "level": "INFO", "logger": "edgeinfer.serve", "msg": msg}),
              flush=True)
    else:
        print(f"edgeinfer serve: {msg}", flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgeinfer serve")
    p.add_argument("--config", help="gateway TOML (default: built-in, with the demo tenant)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct, imported on first use)")
    p.add_argument("--backend-port", type=int, default=0)
    p.add_argument("--backend-arg", action="append", default=[],
                   help="extra flag for the backend (edgeinfer backend --help; repeatable)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: every log line of serve, the gateway and the backends a JSON object (ts, level, "
                        "logger, msg, request_id, trace_id)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="OpenTelemetry: the gateway and the backends send traces to this OTLP/HTTP collector (else "
                        "OTEL_EXPORTER_OTLP_ENDPOINT; neither: no tracing); needs pip install 'edgeinfer[otlp]'")
    p.add_argument("--speculative", default=None, choices=["ngram", "mtp", "off"],
                   help="speculative decoding on every backend (edgeinfer backend --speculative; default ngram)")
    p.add_argument("--nodes", type=int, default=1,
                   help="colocated: this many backends with --role both (each prefills and decodes its own requests)")
    p.add_argument("--prefill-nodes", type=int, default=0,
                   help="disaggregated: this many backends with --role prefill (needs --decode-nodes; "
                        "docs/DISAGGREGATION.md)")
    p.add_argument("--decode-nodes", type=int, default=0,
                   help="disaggregated: this many backends with --role decode (needs --prefill-nodes)")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--redis-url", default=None,
                       help="use this Redis/valkey for the page store, index and registry instead of the embedded one")
    p.add_argument("--redis-cluster", action="store_true",
                   help="--redis-url names a node of a Redis/valkey Cluster: the gateway's index, rate limits and "
                        "leases and every backend's page store, index and registry use it as a cluster")
    store.add_argument("--no-page-store", action="store_true",
                       help="no shared page store, index or registry (the backend's own prefix cache only)")
    p.add_argument("--valkey-maxmemory", type=int, default=MAXMEMORY,
                   help="bytes the embedded valkey keeps before evicting the coldest pages (default 256 MiB: "
                        "~1,400 fp8 pages of the default model, 22k tokens of shared prefixes, half what the "
                        "backend's own KV pool holds; docs/OPERATIONS.md)")
    p.add_argument("--allow-public-demo-key", action="store_true",
                   help="serve the built-in demo tenant (its key sk-edgeinfer-demo is public, in the README) on a "
                        "non-loopback --host; without it serve refuses to (configure your own tenants instead)")
    env_defaults(p, known_elsewhere=BACKEND_OPTIONS)
    return p


def prepare_default_model() -> Path:
    """The default model's directory, imported from its GGUF on first use in a child process: the import loads
    torch and numpy and peaks at ~600 MB, which this process (the gateway's, for as long as serve runs) would
    otherwise keep (measured: 390 MB resident after a first start against 104 MB after a later one)."""
    code = ("from edgeinfer.backend.model.gguf_import import ensure_native_default_model as e; "
            "print(e(progress=True))")
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    lines = (r.stdout or "").strip().splitlines()
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"importing the default model failed (exit {r.returncode}); see the lines above")
    return Path(lines[-1])


def port_in_use(host: str, port: int) -> str | None:
    """None if host:port can be bound now, else why not. SO_REUSEADDR, as the servers bind: a socket in
    TIME_WAIT from the last run (an immediate restart) is not in use; a listening one still is."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    t0 = time.monotonic()
    next_note = t0 + PROGRESS_EVERY_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"backend exited with code {proc.returncode} before it was ready (its log is above)")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise RuntimeError(f"backend at {url} not ready after {timeout_s:.0f} s (--ready-timeout)")
        if now >= next_note:
            say(f"backend still starting ({now - t0:.0f} s: loading the model, on a first start compiling the "
                "CPU kernels)")
            next_note = now + PROGRESS_EVERY_S
        time.sleep(0.25)


def main(argv: list[str]) -> int:
    refuse_in_production()
    cli = parser()
    args = cli.parse_args(argv)

    def bad(dest: str, expected: str) -> None:
        cli.error(f"{named(cli, args, dest, argv)}: expected {expected}")

    if args.port is not None and not 1 <= args.port <= 65535:
        bad("port", "a TCP port 1..65535")
    if not 0 <= args.backend_port <= 65535:
        bad("backend_port", "a TCP port 1..65535 (0: a free one)")
    if not 0 < args.ready_timeout < float("inf"):
        bad("ready_timeout", "a finite number of seconds > 0")
    if args.valkey_maxmemory < 1 << 20:
        bad("valkey_maxmemory", "bytes >= 1 MiB")
    for dest in ("prefill_nodes", "decode_nodes"):
        if getattr(args, dest) < 0:
            bad(dest, "an integer >= 0")
    if (args.prefill_nodes > 0) != (args.decode_nodes > 0):
        cli.error(f"{named(cli, args, 'prefill_nodes', argv)} {named(cli, args, 'decode_nodes', argv)}: expected "
                  "both >= 1 (a disaggregated deployment) or neither")
    if args.nodes < 1:
        bad("nodes", "an integer >= 1")
    if args.prefill_nodes and args.nodes != 1:
        cli.error("--nodes (colocated backends) and --prefill-nodes/--decode-nodes (disaggregated) exclude each other")
    if args.redis_cluster and not args.redis_url:
        cli.error("--redis-cluster needs --redis-url (a node of the cluster); the embedded valkey is one server")
    if (args.prefill_nodes or args.nodes > 1) and args.backend_port:
        cli.error("--backend-port names one backend's port; with several backends each gets a free port")
    from edgeinfer.gateway import cli as gateway_cli
    from edgeinfer.gateway import config as config_mod

    global _JSON_LINES
    _JSON_LINES = args.log_format == "json"
    try:
        gateway_cli.setup_logging(args.log_format)
        obs.setup_tracing("edgeinfer-gateway", args.otlp_endpoint)
    except (RuntimeError, ValueError) as e:
        print(f"edgeinfer serve: error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = gateway_cli.load_config(args.config)
    except config_mod.ConfigError as e:
        print(f"edgeinfer serve: error: {e}", file=sys.stderr)
        return 2
    host, port = args.host or cfg.server.host, args.port or cfg.server.port
    cfg = msgspec.structs.replace(cfg, server=msgspec.structs.replace(
        cfg.server, host=host, allow_public_demo_key=args.allow_public_demo_key or cfg.server.allow_public_demo_key))
    try:
        config_mod.check_tenant_keys(cfg)      # before anything starts: the demo key beyond loopback, placeholders
    except config_mod.ConfigError as e:
        print(f"edgeinfer serve: error: {e}", file=sys.stderr)
        return 2
    for what, h, p in (("gateway", host, port), ("backend", "127.0.0.1", args.backend_port)):
        why = port_in_use(h, p) if p else None
        if why:
            print(f"edgeinfer serve: error: {what} port {h}:{p} is not free ({why}); pick another with "
                  f"--{'port' if what == 'gateway' else 'backend-port'}", file=sys.stderr)
            return 2
    owner = HomeLock.take()
    if isinstance(owner, str):
        print(f"edgeinfer serve: error: {owner}", file=sys.stderr)
        return 2
    children = Children()
    raise_on_stop_signals()
    try:
        return _start(args, cfg, children)
    except Stopped as e:
        say(f"stopped by {e} during start-up")
        return exit_code(e.signum)
    except (RuntimeError, ValueError, OSError, config_mod.ConfigError) as e:
        print(f"edgeinfer serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        children.stop_all()
        clear_running()
        owner.release()


def _start(args: argparse.Namespace, cfg, children: Children) -> int:
    from edgeinfer.gateway import cli as gateway_cli
    from edgeinfer.gateway import config as config_mod

    local = LocalSecrets.load_or_create()
    redis_url: str | None = None
    if args.redis_url:
        redis_url = args.redis_url
        say("page store: the Redis at --redis-url")
    elif not args.no_page_store:
        try:
            valkey = LocalValkey(home_dir() / "valkey", local.valkey_password, args.valkey_maxmemory).start(children)
        except ValkeyError as e:
            raise RuntimeError(f"{e} (or run with --no-page-store)") from e
        redis_url = valkey.url
        say(f"page store: embedded valkey on 127.0.0.1:{valkey.port} (pages kept in {valkey.data_dir})")
    else:
        say("page store: off (--no-page-store): no shared pages, index or registry")

    if args.model:
        model_dir = Path(args.model)
    else:
        say("preparing the default model (the first run imports the GGUF, its INT4 blocks kept)")
        model_dir = prepare_default_model()

    env = dict(os.environ)
    for name, value in ((cfg.server.page_seed_env, local.cache_seed), (PAGE_KEY_ENV, local.page_key)):
        env.setdefault(name, value)   # an operator's own value wins; else this machine's kept one
        os.environ.setdefault(name, value)
    secret_env = cfg.server.internal_secret_env
    if not env.get(secret_env):   # the backend reads only the env var; a fresh one unless the config has one
        env[secret_env] = cfg.server.internal_secret or secrets.token_hex(32)
        os.environ[secret_env] = env[secret_env]
    config_mod.check_secrets(cfg)    # the operator's own secrets (env or config), now that the defaults are set
    if redis_url:   # in the environment, not argv: the URL holds valkey's password and argv is in `ps`
        env[REDIS_URL_ENV] = redis_url
    else:
        env.pop(REDIS_URL_ENV, None)
    # with a page store, no host tier in the backend: on one machine it would hold a third copy of the pages the
    # backend's own KV pool and valkey (over loopback) already hold (measured: +290 MB of the backend's peak
    # under bench_peers' load); an operator's --backend-arg=--host-store-bytes=N comes later and wins
    store_args = ["--host-store-bytes", "0"] if redis_url else ["--store-tier", "none"]
    roles = (["prefill"] * args.prefill_nodes + ["decode"] * args.decode_nodes) if args.prefill_nodes else \
        ["both"] * args.nodes
    ports: list[int] = []
    while len(ports) < len(roles):     # every backend's port known first: decode nodes are told the prefill nodes'
        port = args.backend_port or gateway_cli.free_port()
        if port not in ports or args.backend_port:
            ports.append(port)
    prefill_urls = ",".join(f"http://127.0.0.1:{p}" for p, r in zip(ports, roles, strict=True) if r == "prefill")
    started = []
    for i, role in enumerate(roles):
        bport = ports[i]
        node_id = f"local-{i}" if role == "both" else f"local-{role}-{sum(r == role for r in roles[:i])}"
        cmd = [sys.executable, "-m", "edgeinfer.backend.server", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(bport), "--node-id", node_id, *store_args, *(["--role", role] if role != "both" else []),
               *(["--handoff-peers", prefill_urls] if role == "decode" else []),
               *(["--speculative", args.speculative] if args.speculative else []),
               *(["--redis-cluster"] if args.redis_cluster else []),
               *(["--log-format", "json"] if args.log_format == "json" else []),
               *(["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []), *args.backend_arg]
        say(f"starting the backend{'' if len(roles) == 1 else f' {node_id}'}: {' '.join(cmd)}")
        started.append((node_id, f"http://127.0.0.1:{bport}", children.start(node_id, cmd, env=env)))
    for _, url, proc in started:
        wait_ready(proc, url, args.ready_timeout)
    first_url = started[0][1]
    info = gateway_cli.backend_info(first_url, timeout_s=10, headers=cfg.internal_auth)
    cfg = gateway_cli.override(cfg, args.host, args.port, [f"{info['model']}={model_dir}"], [])
    data = msgspec.to_builtins(cfg)
    data["nodes"] = [{"id": node_id, "url": url, "model": info["model"]} for node_id, url, _ in started]
    if redis_url:
        data["server"]["redis_url"] = redis_url
        data["server"]["redis_cluster"] = bool(args.redis_cluster)
    cfg = config_mod.parse(data, cfg.source)
    s = cfg.server
    running = write_running(f"http://{s.host}:{s.port}", redis_url)
    if redis_url:
        say(f"`edgeinfer ops status` on this machine reads the registry from {running}")
    gateway_cli.run_loop(gateway_cli.serve_gateway(
        cfg, ready_line=f"edgeinfer serve: ready: http://{s.host}:{s.port}/v1 model={info['model']} "
                        f"(demo key: {config_mod.DEMO_API_KEY})"))
    return 0


def run(cmd: str, argv: list[str]) -> int:
    return main(argv)
