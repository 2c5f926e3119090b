"""The stub backend (tests/gateway/stub_backend.py) as its own process, for faults a thread cannot
take (SIGSTOP, SIGKILL), optionally registered in a real Redis by the backends' own heartbeat driver
(cache_store.registry.keep_registered over a RedisNodeRegistry, as backend.page_store.bridge does).

  python -m tests.gateway.stub_process --node-id N --tokenizer DIR [--port P] [--redis-url URL]
      [--heartbeat S] [--first-token-delay S] [--token-delay S] [--internal-secret S]

--internal-secret: /internal/* wants it, and the registry records are signed with it (as a real backend).

Prints one JSON line {"port": P} once listening; SIGTERM stops listening, then deregisters. GET /stub/stats answers what the stub saw:
request ids received, completed, aborted (/internal/abort), disconnected mid-request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from aiohttp import web

from tests.gateway.stub_backend import StubBackend

REPO = Path(__file__).resolve().parents[2]


async def serve(args: argparse.Namespace) -> None:
    from edgeinfer.protocol.tokenizer import Tokenizer

    stub = StubBackend(args.node_id, Tokenizer.from_dir(args.tokenizer))
    stub.behaviour.first_token_delay_s = args.first_token_delay
    stub.behaviour.token_delay_s = args.token_delay
    stub.secret = args.internal_secret
    app = stub.app()

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"requests": [r.request_id for r in stub.requests], "completed": stub.completed,
                                  "aborts": stub.aborts, "disconnects": stub.disconnects})

    app.router.add_get("/stub/stats", stats)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, reuse_address=True)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    beats = registry = None
    if args.redis_url:
        from edgeinfer.cache_store.node_auth import NodeRecordKey
        from edgeinfer.cache_store.registry import NodeRecord, RedisNodeRegistry, keep_registered
        from edgeinfer.cache_store.resilience import RedisGuard, redis_client

        registry = RedisNodeRegistry(redis_client(args.redis_url), heartbeat_s=args.heartbeat,
                                     guard=RedisGuard(timeout_s=0.5),
                                     signer=NodeRecordKey(args.internal_secret) if args.internal_secret else None)
        started = time.time()

        def record() -> NodeRecord:
            return NodeRecord(args.node_id, f"http://127.0.0.1:{port}", stub.model, "stub-1", started_at=started)

        landed = await registry.register(record())
        beats = asyncio.create_task(keep_registered(registry, record, landed=landed))
    print(json.dumps({"port": port}), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if beats is not None and registry is not None:   # like backend.page_store.bridge.stop: leave the registry
        beats.cancel()
        await registry.deregister(args.node_id)


class StubProcess:
    """Start/stop one stub backend process; `pid` for signals."""

    def __init__(self, node_id: str, tokenizer_dir: Path, *extra: str) -> None:
        self.node_id = node_id
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.gateway.stub_process", "--node-id", node_id,
                                      "--tokenizer", str(tokenizer_dir), *extra],
                                     cwd=REPO, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"stub process {node_id} exited with {self.proc.wait(5)} before listening")
        self.port = json.loads(line)["port"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        import requests

        return requests.get(self.url + "/stub/stats", timeout=5).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)   # a stopped process cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--node-id", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--redis-url", default="")
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--first-token-delay", type=float, default=0.0)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--internal-secret", default="")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
