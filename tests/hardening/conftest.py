"""Fixtures for the hardening suite: the gateway harness (stub backends, byte-level tokenizer) from
tests/gateway, plus one module-scoped valkey-server."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import harness, tokenizer, tokenizer_dir  # noqa: F401  (re-exported fixtures)
from tests.redis_server import ValkeyServer


@pytest.fixture(scope="module")
def valkey():
    server = ValkeyServer().start()
    try:
        yield server
    finally:
        server.stop()
