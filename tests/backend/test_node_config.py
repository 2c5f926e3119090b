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


def test_every_flag_can_come_from_the_environment(monkeypatch, capsys):
    """EDGEINFER_ARG_<FLAG> (as llama-server's LLAMA_ARG_*): the variable is the default, the command line wins,
    --help names it, a bad value is refused naming the variable."""
    monkeypatch.setenv("EDGEINFER_ARG_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("EDGEINFER_ARG_NO_PREFIX_CACHE", "yes")
    monkeypatch.setenv("EDGEINFER_ARG_SPECULATIVE", "off")
    cfg = parse_args(["--insecure-no-internal-auth"])
    assert (cfg.max_num_seqs, cfg.no_prefix_cache, cfg.speculative) == (7, True, "off")
    assert parse_args(["--insecure-no-internal-auth", "--max-num-seqs", "3"]).max_num_seqs == 3
    for name, value, needle in (("EDGEINFER_ARG_MAX_NUM_SEQS", "many", "EDGEINFER_ARG_MAX_NUM_SEQS='many'"),
                                ("EDGEINFER_ARG_SPECULATIVE", "eagle", "expected one of ngram, mtp, off"),
                                ("EDGEINFER_ARG_NO_PREFIX_CACHE", "maybe", "expected one of 1, true")):
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit):
            parse_args(["--insecure-no-internal-auth"])
        assert needle in capsys.readouterr().err
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "EDGEINFER_ARG_KV_CACHE_BYTES" in capsys.readouterr().out.replace("\n", "").replace(" ", "")


def test_serve_flags_come_from_the_environment_too(monkeypatch):
    from edgeinfer.ops.serve import parser

    monkeypatch.setenv("EDGEINFER_ARG_PREFILL_NODES", "2")
    monkeypatch.setenv("EDGEINFER_ARG_BACKEND_ARG", "--spec-tokens 2")
    a = parser().parse_args(["--decode-nodes", "1"])
    assert (a.prefill_nodes, a.decode_nodes, a.backend_arg) == (2, 1, ["--spec-tokens", "2"])
    assert "EDGEINFER_ARG_VALKEY_MAXMEMORY" in parser().format_help().replace("\n", "").replace(" ", "")
