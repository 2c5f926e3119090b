"""Fast checks of the ops CLI that need no model: templates, usage errors, a dead node's health."""

from __future__ import annotations

import pytest

from edgeinfer.ops.commands import run
from edgeinfer.ops.node_client import NodeClient
from edgeinfer.ops.rollout import Rollout, RolloutOptions, Target, check_template, render

T = Target("node-a", "http://10.0.0.5:8100", "smol", "v1")


def test_render_fills_and_quotes_placeholders():
    cmd = render("restart --id {node_id} --port {port} --host {host} --to {version} --from {old_version} "
                 "--url {url} --model {model}", T, "v2; rm -rf /")
    assert cmd == ("restart --id node-a --port 8100 --host 10.0.0.5 --to 'v2; rm -rf /' --from v1 "
                   "--url http://10.0.0.5:8100 --model smol")


@pytest.mark.parametrize("template", ["x {nodeid}", "x {port:05d}", "x {version!r}"])
def test_bad_placeholder_is_refused_before_anything_runs(template):
    with pytest.raises(ValueError, match="placeholder"):
        check_template(template)


def test_dry_run_prints_the_plan_and_touches_nothing(capsys):
    opts = RolloutOptions(command="restart {node_id} {version}", to_version="v2", operator_key=None, dry_run=True)
    assert Rollout([T], opts).run() == 0
    out = capsys.readouterr().out
    assert "node-a (http://10.0.0.5:8100): v1 -> v2" in out and "`restart node-a v2`" in out and "dry run" in out


def test_usage_errors_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("EDGEINFER_REDIS_URL", raising=False)
    assert run("ops", ["status"]) == 2
    assert "no registry" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run("ops", ["rollout", "--model", "m"])
    assert e.value.code == 2


def test_unreachable_node_is_not_healthy():
    node = NodeClient("http://127.0.0.1:9", "k", timeout_s=0.5)
    h = node.health()
    assert not h.ok and "127.0.0.1:9" in h.error
    assert "not healthy after 0.3s" in node.wait_healthy(0.3, poll_s=0.1)
    assert not node.canary(timeout_s=0.5).ok


def test_status_leaves_out_records_not_signed_with_the_internal_secret(capsys, monkeypatch):
    import json
    import time

    import msgspec
    import redis

    from edgeinfer.cache_store.node_auth import NodeRecordKey
    from edgeinfer.cache_store.registry import NodeRecord
    from tests.support.redis_server import ValkeyServer

    secret = "ops-test-internal-secret-0123"
    now = time.time()
    genuine = NodeRecordKey(secret).sign(NodeRecord("real", "http://10.0.0.5:8100", "smol", "v1", updated_at=now), 60)
    forged = NodeRecord("evil", "http://10.6.6.6:8100", "smol", "v1", updated_at=now)
    server = ValkeyServer().start()
    try:
        r = redis.Redis.from_url(server.url)
        for rec in (genuine, forged):
            r.set(f"ei:node:{rec.node_id}", msgspec.json.encode(rec))
            r.sadd("ei:nodes", rec.node_id)
        monkeypatch.delenv("EDGEINFER_INTERNAL_SECRET", raising=False)
        assert run("ops", ["status", "--json", "--redis-url", server.url]) == 0   # no secret: shown as before
        assert [n["node_id"] for n in json.loads(capsys.readouterr().out)] == ["evil", "real"]
        monkeypatch.setenv("EDGEINFER_INTERNAL_SECRET", secret)
        assert run("ops", ["status", "--json", "--redis-url", server.url]) == 0
        out, err = capsys.readouterr()
        assert [n["node_id"] for n in json.loads(out)] == ["real"]
        assert "'evil'" in err and "unsigned" in err and secret not in err
        assert run("ops", ["drain", "evil", "--redis-url", server.url, "--operator-key", "k"]) == 2
        assert "unknown node 'evil'" in capsys.readouterr().err
    finally:
        server.stop()
