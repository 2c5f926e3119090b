"""tests/e2e: the claims checked through the public API (the hardening suite: bad input, tenant isolation, faults,
poison values, queueing, signed records), each marked `e2e`. Fixtures: the gateway harness (stub backends,
byte-level tokenizer) from tests/gateway; the module-scoped valkey fixture is tests/conftest.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gateway.conftest import harness, tokenizer, tokenizer_dir  # noqa: F401  (re-exported fixtures)

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
