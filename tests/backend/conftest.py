"""Fixtures shared by the backend tests that need a real Redis-compatible server."""

from __future__ import annotations

import pytest

from tests.redis_server import ValkeyServer


@pytest.fixture(scope="module")
def valkey():
    server = ValkeyServer().start()
    try:
        yield server
    finally:
        server.stop()
