"""Fixtures for the hardening suite: the gateway harness (stub backends, byte-level tokenizer) from
tests/gateway (the valkey fixture is tests/conftest.py's)."""

from __future__ import annotations

from tests.gateway.conftest import harness, tokenizer, tokenizer_dir  # noqa: F401  (re-exported fixtures)
