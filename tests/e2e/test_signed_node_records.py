"""Redis is untrusted: a node record the gateway did not get from a holder of the internal secret is never
probed nor routed to (issue 14, item 5). The gateway sends its secret on every probe and tenants' prompts
on every request, so a forged `ei:node:<id>` pointing at an attacker's listener would get both.

The attacker here writes records straight into a real valkey (no secret, or the wrong one, or a genuine
record changed or replayed); its listener records every byte it is sent. The genuine node is the stub
backend in its own process, registering signed records through the real RedisNodeRegistry.
"""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import redis
import requests

from edgeinfer.cache_store.node_auth import NodeRecordKey
from edgeinfer.cache_store.registry import NodeRecord
from edgeinfer.gateway import config as config_mod
from tests.conftest import wait_until
from tests.gateway.conftest import MODEL, client, tenant
from tests.gateway.stub_process import StubProcess
from tests.support.redis_server import ValkeyServer

SECRET = "signed-records-test-internal-secret"
ADMIN = "gw-signed-records-admin"
MSGS = [{"role": "user", "content": "hi"}]
TTL = 3 * 0.5   # the stub's heartbeat (0.5 s) x 3


class Listener:
    """The attacker's server: accepts anything, answers nothing, keeps every byte received."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = b""
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.settimeout(0.5)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def _nodes(gw) -> dict:
    return requests.get(gw.url + "/admin/nodes", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5).json()


def _refused(gw, reason: str) -> float:
    for line in requests.get(gw.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'edgeinfer_gateway_node_records_refused_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _forge(kind: str, listener_url: str, real_url: str) -> tuple[NodeRecord, str]:
    """A record an attacker without the secret can produce, and the refusal reason the gateway must give."""
    now = time.time()
    base = NodeRecord(f"evil-{kind}", listener_url, MODEL, "stub-1", started_at=now, updated_at=now)
    if kind == "unsigned":
        return base, "unsigned"
    if kind == "other-secret":
        return NodeRecordKey("an-attacker-chosen-secret-0123").sign(base, TTL), "bad_signature"
    if kind == "tampered-url":   # a genuine record for the real node, its url changed afterwards
        genuine = NodeRecordKey(SECRET).sign(msgspec.structs.replace(base, url=real_url), TTL)
        return msgspec.structs.replace(genuine, url=listener_url), "bad_signature"
    if kind == "stale-replay":   # genuinely signed long ago (e.g. by a node since gone from that address)
        old = msgspec.structs.replace(base, updated_at=now - 120)
        return NodeRecordKey(SECRET).sign(old, TTL), "expired"
    raise ValueError(kind)


def _plant(r: redis.Redis, record: NodeRecord) -> None:
    r.set(f"ei:node:{record.node_id}", msgspec.json.encode(record), px=600_000)
    r.sadd("ei:nodes", record.node_id)


@pytest.fixture
def deployment(harness, tokenizer_dir):
    server = ValkeyServer().start()
    listener = Listener()
    real = None
    try:
        real = StubProcess("real", tokenizer_dir, "--redis-url", server.url, "--internal-secret", SECRET)
        gw = harness.gateway([], tenants=[tenant(requests_per_min=1_000_000)], redis_url=server.url,
                             index_fill="backends", internal_secret=SECRET,
                             admin_key_sha256=config_mod.hash_key(ADMIN))
        yield gw, real, listener, redis.Redis.from_url(server.url)
    finally:
        listener.close()
        if real is not None:
            real.stop()
        server.stop()


@pytest.mark.parametrize("kind", ["unsigned", "other-secret", "tampered-url", "stale-replay"])
def test_forged_node_record_is_never_probed_nor_routed_to(deployment, kind):
    gw, real, listener, r = deployment
    forged, reason = _forge(kind, listener.url, real.url)
    _plant(r, forged)
    # positive control: the genuine, signed record of the real node is believed and routed to
    assert wait_until(lambda: _nodes(gw).get("real", {}).get("routable"), 15), _nodes(gw)
    before = len(real.stats()["requests"])
    for _ in range(6):
        out = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
        assert out.choices[0].message.content == "The"
    assert len(real.stats()["requests"]) == before + 6
    time.sleep(1.0)   # five more health intervals (0.2 s) with the forged record listed
    assert SECRET.encode() not in listener.received
    assert listener.connections == 0 and listener.received == b"", listener.received[:300]
    assert forged.node_id not in _nodes(gw)
    assert _refused(gw, reason) >= 5, "the gateway never listed the forged record: the test proved nothing"


def test_a_record_signed_with_the_secret_is_believed_so_the_listener_would_see_it(deployment):
    """Control for the test above: the same listener, announced by a correctly signed current record, IS
    probed (with the secret): the listener can observe what the forged records must not get."""
    gw, real, listener, r = deployment
    assert wait_until(lambda: _nodes(gw).get("real", {}).get("routable"), 15), _nodes(gw)
    now = time.time()
    signed = NodeRecordKey(SECRET).sign(NodeRecord("signed", listener.url, MODEL, "stub-1", updated_at=now), 600)
    _plant(r, signed)
    assert wait_until(lambda: listener.connections > 0, 10)
    assert wait_until(lambda: b"GET /ready" in listener.received, 5), listener.received[:300]
    assert "signed" in _nodes(gw)
