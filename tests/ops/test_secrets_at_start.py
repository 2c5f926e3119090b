"""Issue 54, operators: a secret that is a placeholder, a documented default or too weak is refused at start with
one line naming it (backend, gateway, serve), and the public demo key is served beyond loopback only when the
operator says so. Through the real commands (`python -m edgeinfer.ops.cli ...`), which exit before anything
starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgeinfer.backend.node_config import parse_args
from edgeinfer.gateway import config as config_mod
from edgeinfer.protocol.secrets import is_loopback, weak_secret

STRONG = "9f2c1d0b8e7a6f5e4d3c2b1a0f9e8d7c"


@pytest.mark.parametrize("value", ["REPLACE-with-64-hex-chars", "compose-internal-secret-change-me-0123456789abcdef",
                                   "edgeinfer-dev-seed", "sk-change-me", "short", "aaaaaaaaaaaaaaaaaaaaaaaa",
                                   "your-secret-here-0123456789", "PLACEHOLDER_VALUE_0123456789"])
def test_weak_values_are_named(value):
    assert weak_secret(value)


def test_generated_values_pass():
    import secrets

    for _ in range(50):
        assert weak_secret(secrets.token_hex(32)) is None
    assert weak_secret(STRONG) is None


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.9")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("::")


@pytest.mark.parametrize(("env", "needle"), [
    ({"EDGEINFER_INTERNAL_SECRET": "REPLACE-with-64-hex-chars"}, "internal secret from $EDGEINFER_INTERNAL_SECRET"),
    ({"EDGEINFER_INTERNAL_SECRET": STRONG, "EDGEINFER_OPERATOR_KEY": "compose-operator-key-change-me"},
     "operator key ($EDGEINFER_OPERATOR_KEY) refused"),
    ({"EDGEINFER_INTERNAL_SECRET": STRONG, "EDGEINFER_PAGE_KEY": "REPLACE-with-64-hex-chars"},
     "page key ($EDGEINFER_PAGE_KEY) refused"),
    ({"EDGEINFER_INTERNAL_SECRET": STRONG, "EDGEINFER_CACHE_SEED": "REPLACE-with-32-hex-chars"},
     "cache seed ($EDGEINFER_CACHE_SEED) refused"),
])
def test_the_backend_refuses_a_placeholder_naming_it(monkeypatch, capsys, env, needle):
    for k in ("EDGEINFER_OPERATOR_KEY", "EDGEINFER_PAGE_KEY", "EDGEINFER_CACHE_SEED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit):
        parse_args(["--cache-seed", env["EDGEINFER_CACHE_SEED"]] if "EDGEINFER_CACHE_SEED" in env else [])
    assert needle in capsys.readouterr().err.replace("--cache-seed", "$EDGEINFER_CACHE_SEED")


def test_the_backend_refuses_the_development_seed_beyond_loopback(monkeypatch, capsys):
    monkeypatch.setenv("EDGEINFER_INTERNAL_SECRET", STRONG)
    monkeypatch.delenv("EDGEINFER_CACHE_SEED", raising=False)
    monkeypatch.delenv("EDGEINFER_OPERATOR_KEY", raising=False)
    monkeypatch.delenv("EDGEINFER_PAGE_KEY", raising=False)
    assert parse_args([]).host == "127.0.0.1"      # a developer's loopback node keeps the default
    with pytest.raises(SystemExit):
        parse_args(["--host", "0.0.0.0"])
    assert "built-in development seed" in capsys.readouterr().err
    monkeypatch.setenv("EDGEINFER_CACHE_SEED", STRONG)
    assert parse_args(["--host", "0.0.0.0"]).cache_seed == STRONG


def _cfg(host: str, **server) -> config_mod.GatewayConfig:
    return config_mod.parse({"server": {"host": host, **server},
                             "tenants": [{"id": "demo", "api_key_sha256": [config_mod.hash_key("sk-edgeinfer-demo")]}]})


def test_the_gateway_serves_the_demo_key_beyond_loopback_only_when_told(monkeypatch):
    monkeypatch.setenv("EDGEINFER_CACHE_SEED", STRONG)
    config_mod.check_secrets(_cfg("127.0.0.1"))
    with pytest.raises(config_mod.ConfigError, match="public demo key"):
        config_mod.check_secrets(_cfg("0.0.0.0"))
    config_mod.check_secrets(_cfg("0.0.0.0", allow_public_demo_key=True))
    placeholder = config_mod.parse({"tenants": [{"id": "t", "api_key_sha256": [config_mod.hash_key("sk-change-me")]}]})
    with pytest.raises(config_mod.ConfigError, match="placeholder key 'sk-change-me'"):
        config_mod.check_secrets(placeholder)
    monkeypatch.setenv("EDGEINFER_INTERNAL_SECRET", "REPLACE-with-64-hex-chars")
    with pytest.raises(config_mod.ConfigError, match="internal secret"):
        config_mod.check_secrets(_cfg("127.0.0.1"))


def _run(tmp_path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "EDGEINFER_HOME": str(tmp_path), **env}
    for k in ("EDGEINFER_INTERNAL_SECRET", "EDGEINFER_CACHE_SEED"):
        if k not in env:
            full.pop(k, None)
    return subprocess.run([sys.executable, "-m", "edgeinfer.ops.cli", *argv], env=full, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


@pytest.mark.slow
def test_the_real_commands_refuse_with_one_line(tmp_path):
    r = _run(tmp_path, "serve", "--host", "0.0.0.0", "--port", "18999")      # the image's default command
    assert r.returncode == 2 and "public demo key" in r.stderr and "--allow-public-demo-key" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _run(tmp_path, "gateway", EDGEINFER_INTERNAL_SECRET="REPLACE-with-64-hex-chars")
    assert r.returncode == 2 and "internal secret" in r.stderr and "Traceback" not in r.stderr
    r = _run(tmp_path, "backend", EDGEINFER_INTERNAL_SECRET="compose-internal-secret-change-me-0123456789abcdef")
    assert r.returncode == 2 and "placeholder" in r.stderr and "Traceback" not in r.stderr
