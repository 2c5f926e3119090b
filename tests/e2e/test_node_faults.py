"""Node faults one tenant's request must not turn into another's failure (issue 14, items 3 and 4).

- Redis SIGKILLed and restarted EMPTY under a gateway that finds its nodes in the registry, with clients
  calling the whole time: no request fails (the gateway keeps its last-known nodes while the listing is
  empty), and the backends' heartbeats put their records back within a few beats.
- A backend SIGSTOPped (it still accepts TCP connections, answers nothing) while requests wait on it for
  their first byte, with first_byte_timeout_s = 120: those requests finish on the other node within
  seconds, are aborted on the stopped one, and no new request is routed to it.

Backends are the stub backend in its own process (tests/gateway/stub_process.py: real HTTP, registered
through the real RedisNodeRegistry by the backends' heartbeat driver).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis
import requests

from edgeinfer.gateway import config as config_mod
from tests.conftest import wait_until
from tests.gateway.conftest import MODEL, client, tenant
from tests.gateway.stub_process import StubProcess
from tests.support.redis_server import ValkeyServer

MSGS = [{"role": "user", "content": "hi"}]
ADMIN = "gw-node-faults-admin"
HEARTBEAT = 4.0   # long, so the gateway surely lists the empty Redis before a node's next beat lands


def _nodes(gw) -> dict:
    return requests.get(gw.url + "/admin/nodes", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5).json()


def _routable(gw) -> set[str]:
    return {n for n, d in _nodes(gw).items() if d["routable"]}


def _retries(gw, node_id: str) -> float:
    for line in requests.get(gw.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("edgeinfer_gateway_upstream_retries_total{") and f'node="{node_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Load:
    """Clients calling the gateway in a loop; every outcome is kept as (seconds, content or 'ERROR ...')."""

    def __init__(self, gw, clients: int = 3) -> None:
        self.results: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(gw,)) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _loop(self, gw) -> None:
        c = client(gw)
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                out = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
                self.results.append((time.monotonic() - t, out.choices[0].message.content or ""))
            except Exception as e:  # noqa: BLE001
                self.results.append((time.monotonic() - t, f"ERROR {e!r}"))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    @property
    def errors(self) -> list[str]:
        return [x for _, x in self.results if x != "The"]


def test_redis_restarting_empty_fails_no_request_and_nodes_re_register(harness, tokenizer_dir):
    server = ValkeyServer().start()
    stubs: list[StubProcess] = []
    load = None
    try:
        stubs = [StubProcess(f"reg-{i}", tokenizer_dir, "--redis-url", server.url, "--heartbeat", str(HEARTBEAT))
                 for i in range(2)]
        gw = harness.gateway([], tenants=[tenant(requests_per_min=1_000_000)], redis_url=server.url,
                             index_fill="backends", admin_key_sha256=config_mod.hash_key(ADMIN))
        assert wait_until(lambda: _routable(gw) == {"reg-0", "reg-1"}, 15), _nodes(gw)
        load = Load(gw)
        assert wait_until(lambda: len(load.results) >= 20, 30)
        server.kill()
        server.start()                                  # same port, empty: no node records at all
        back = time.monotonic()
        r = redis.Redis.from_url(server.url)
        listed_empty = 0        # SMEMBERS calls (only the gateway's listing sends them) while no record exists
        while (n_records := r.exists("ei:node:reg-0", "ei:node:reg-1")) < 2:
            if n_records == 0:
                listed_empty = r.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0)
            assert time.monotonic() - back < 20, r.keys("*")
            time.sleep(0.01)
        took = time.monotonic() - back
        assert r.smembers("ei:nodes") == {b"reg-0", b"reg-1"}
        n = len(load.results)
        assert wait_until(lambda: len(load.results) >= n + 40, 30), "clients stopped getting answers"
        load.stop()
        assert listed_empty >= 1, "the gateway never listed the empty registry: the test proved nothing"
        assert not load.errors, (len(load.errors), load.errors[:3])
        assert took < 2 * HEARTBEAT, f"node records back {took:.2f}s after the restart (heartbeat {HEARTBEAT}s)"
        assert _routable(gw) == {"reg-0", "reg-1"}
        print(f"\nredis restart: {len(load.results)} requests, 0 failed; the gateway listed the empty registry "
              f"{listed_empty} times; records back after {took:.2f}s")

        # a node that leaves for real still leaves: deregistered, and its probe fails (port closed)
        stubs[1].stop()
        assert wait_until(lambda: set(_nodes(gw)) == {"reg-0"}, 5), _nodes(gw)
    finally:
        if load is not None:
            load.stop()
        for s in stubs:
            s.stop()
        server.stop()


def test_hung_backend_requests_move_to_another_node_before_the_first_byte(harness):
    hung = StubProcess("hung", harness.tokenizer_dir, "--first-token-delay", "1.0")
    live = StubProcess("live", harness.tokenizer_dir, "--first-token-delay", "1.0")
    stopped = False
    try:
        gw = harness.gateway([hung, live], first_byte_timeout_s=120.0,  # type: ignore[list-item]
                             admin_key_sha256=config_mod.hash_key(ADMIN))
        assert wait_until(lambda: _routable(gw) == {"hung", "live"}, 15), _nodes(gw)
        outcomes: list[tuple[float, str]] = []

        def call() -> None:
            t = time.monotonic()
            try:
                out = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
                outcomes.append((time.monotonic() - t, out.choices[0].message.content or ""))
            except Exception as e:  # noqa: BLE001
                outcomes.append((time.monotonic() - t, f"ERROR {e!r}"))

        calls = [threading.Thread(target=call) for _ in range(6)]
        for c in calls:
            c.start()
        # every request is now waiting 1 s for its first token, about half of them on "hung"
        assert wait_until(lambda: len(hung.stats()["requests"]) + len(live.stats()["requests"]) == 6, 10)
        waiting_on_hung = hung.stats()["requests"]
        assert waiting_on_hung, "the load went to one node only"
        os.kill(hung.pid, signal.SIGSTOP)
        stopped = True
        t_stop = time.monotonic()
        for c in calls:
            c.join(timeout=90)
        took = time.monotonic() - t_stop
        assert [x for _, x in outcomes] == ["The"] * 6, outcomes
        assert took < 10, f"the requests waiting on the stopped node took {took:.1f}s (first_byte_timeout_s=120)"
        assert _retries(gw, "hung") == len(waiting_on_hung)

        # new requests go to the live node only: none waits on the stopped one, none is retried off it
        before = len(live.stats()["requests"])
        t0 = time.monotonic()
        for _ in range(4):
            out = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
            assert out.choices[0].message.content == "The"
        assert len(live.stats()["requests"]) == before + 4
        assert _retries(gw, "hung") == len(waiting_on_hung)
        assert "hung" not in _routable(gw)
        print(f"\nSIGSTOP: {len(waiting_on_hung)} of 6 requests moved, all 6 done {took:.2f}s after the stop; "
              f"4 new requests in {time.monotonic() - t0:.2f}s, none on the stopped node")

        os.kill(hung.pid, signal.SIGCONT)
        stopped = False
        # the moved requests were aborted on the stopped node (seen by it once it runs again)
        gone = lambda: set(hung.stats()["disconnects"]) | set(hung.stats()["aborts"])  # noqa: E731
        assert wait_until(lambda: set(waiting_on_hung) <= gone(), 10), hung.stats()
        assert not set(waiting_on_hung) & set(hung.stats()["completed"])
        assert wait_until(lambda: "hung" in _routable(gw), 10), _nodes(gw)   # and it comes back
    finally:
        if stopped:
            os.kill(hung.pid, signal.SIGCONT)
        hung.stop()
        live.stop()


def test_hung_only_node_keeps_its_waiting_request_rather_than_a_503(harness):
    """With no other node to move to, a request waiting on a node that stops answering stays: once the
    node runs again it is answered (moving it would have been a 503 "no healthy backend")."""
    solo = StubProcess("solo", harness.tokenizer_dir, "--first-token-delay", "1.0")
    stopped = False
    try:
        gw = harness.gateway([solo], first_byte_timeout_s=120.0,  # type: ignore[list-item]
                             admin_key_sha256=config_mod.hash_key(ADMIN))
        assert wait_until(lambda: _routable(gw) == {"solo"}, 15), _nodes(gw)
        outcome: list[str] = []

        def call() -> None:
            try:
                out = client(gw).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
                outcome.append(out.choices[0].message.content or "")
            except Exception as e:  # noqa: BLE001
                outcome.append(f"ERROR {e!r}")

        t = threading.Thread(target=call)
        t.start()
        assert wait_until(lambda: len(solo.stats()["requests"]) == 1, 10)
        os.kill(solo.pid, signal.SIGSTOP)
        stopped = True
        assert wait_until(lambda: "solo" not in _routable(gw), 10)     # its probes go unanswered
        time.sleep(1.0)
        os.kill(solo.pid, signal.SIGCONT)
        stopped = False
        t.join(timeout=60)
        assert outcome == ["The"]
        assert _retries(gw, "solo") == 0
    finally:
        if stopped:
            os.kill(solo.pid, signal.SIGCONT)
        solo.stop()


@pytest.mark.parametrize("value", [1, 0, -3, 2.5, True, "3"])
def test_config_health_stale_intervals_must_be_an_integer_of_at_least_2(value):
    with pytest.raises(config_mod.ConfigError, match="health_stale_intervals"):
        config_mod.parse({"server": {"health_stale_intervals": value}})


def test_config_health_stale_intervals_sets_the_probe_timeout_and_staleness():
    from edgeinfer.gateway.state import build_state

    cfg = config_mod.parse({"server": {"health_interval_s": 0.5, "health_stale_intervals": 5}})
    pool = build_state(cfg, models={}).pool
    assert (pool.probe_timeout_s, pool.stale_after_s) == (2.0, 2.5)
    short = build_state(config_mod.parse({"server": {"health_interval_s": 0.1}}), models={}).pool
    assert (short.probe_timeout_s, short.stale_after_s) == (0.5, 0.6)     # default 3, the 0.5 s floor
