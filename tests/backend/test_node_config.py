"""The backend's flags become one frozen BackendConfig (issue 18): defaults shared with the gateway come from
protocol.defaults, the engine config is derived from it once, and the page-store wiring reads typed fields."""

from __future__ import annotations

import dataclasses

import pytest

from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.node_config import BackendConfig
from edgeinfer.backend.page_store.wiring import page_key_from_config
from edgeinfer.backend.server import parse_args
from edgeinfer.cache_store.codec import PageKey
from edgeinfer.protocol.defaults import CACHE_SEED, CACHE_SEED_ENV, KEY_PREFIX, PAGE_SIZE


def test_parse_args_returns_a_frozen_config_with_the_shared_defaults(monkeypatch):
    monkeypatch.delenv(CACHE_SEED_ENV, raising=False)
    cfg = parse_args(["--insecure-no-internal-auth"])
    assert isinstance(cfg, BackendConfig)
    assert (cfg.cache_seed, cfg.redis_key_prefix, cfg.page_size) == (CACHE_SEED, KEY_PREFIX, PAGE_SIZE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1   # type: ignore[misc]


def test_the_engine_config_is_derived_from_the_flags():
    cfg = parse_args(["--insecure-no-internal-auth", "--page-size", "32", "--kv-dtype", "bf16", "--no-prefix-cache",
                      "--cache-seed", "s3cret", "--no-cuda-graphs", "--scheduler", "fifo"])
    eng = cfg.engine_config()
    assert (eng.page_size, eng.kv_dtype, eng.enable_prefix_cache, eng.cache_seed, eng.cuda_graphs, eng.scheduler) == \
        (32, "bf16", False, b"s3cret", False, "fifo")
    defaults = parse_args(["--insecure-no-internal-auth"]).engine_config()
    assert defaults.kv_dtype == "fp8_e4m3"      # the served default (docs/QUANTIZATION.md); in-process engines: auto
    assert dataclasses.replace(defaults, cache_seed=EngineConfig().cache_seed, kv_dtype="auto") == EngineConfig()


def test_a_namespace_missing_a_field_is_refused():
    import argparse

    with pytest.raises(TypeError):
        BackendConfig.from_namespace(argparse.Namespace(port=1))


def test_the_page_key_comes_from_the_typed_config(monkeypatch, tmp_path):
    monkeypatch.delenv("EDGEINFER_PAGE_KEY", raising=False)
    cfg = parse_args(["--insecure-no-internal-auth", "--cache-seed", "seed-a"])
    assert page_key_from_config(cfg).key == PageKey.from_seed(b"seed-a").key
    (tmp_path / "k").write_bytes(b"a-file-secret-0123456789\n")
    keyed = dataclasses.replace(cfg, page_key_file=str(tmp_path / "k"))
    assert page_key_from_config(keyed).key == PageKey.from_secret(b"a-file-secret-0123456789").key
