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
    assert defaults.kv_dtype == "auto"     # a node's auto: the measured gate picks it before the engine is built
    assert dataclasses.replace(defaults, cache_seed=EngineConfig().cache_seed) == EngineConfig()


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


def _options(p) -> set[str]:
    return {a.dest for a in p._actions if a.option_strings and a.dest != "help"}


def test_the_shared_option_lists_match_both_parsers():
    """protocol.defaults names each command's options (serve's environment reaches its backends); they must not
    drift from the parsers."""
    import argparse

    from edgeinfer.ops.serve import parser
    from edgeinfer.protocol.defaults import BACKEND_OPTIONS, SERVE_OPTIONS

    captured = {}

    def grab(self, args=None, namespace=None):
        captured["p"] = self
        raise SystemExit(0)
    orig = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab   # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = orig  # type: ignore[method-assign]
    assert _options(captured["p"]) == BACKEND_OPTIONS
    assert _options(parser()) == SERVE_OPTIONS


# Issue 53, item 7: each value the option refuses, set from the environment, is refused naming the variable; the
# numeric options are range-checked in either form.
REFUSED = [("PORT", "99999"), ("PORT", "0"), ("HEARTBEAT", "-1"), ("KV_CACHE_BYTES", "-5"), ("MAX_NUM_SEQS", "0"),
           ("SPEC_TOKENS", "40"), ("SPEC_MAX_BATCH", "-1"), ("HANDOFF_TIMEOUT", "0"), ("KEEPALIVE_S", "-1"),
           ("MAX_QUEUE_WAIT_S", "inf"), ("CONTENDED_STEP_TOKENS", "-3"), ("CONTENDED_STEP_RATIO", "-1"),
           ("CONTENDED_WINDOW_S", "-2"), ("KV_VERIFY_FRACTION", "2"), ("ADVERTISE_URL", "ftp://x"),
           ("NUM_PAGES", "0"), ("MAX_NUM_BATCHED_TOKENS", "0"), ("STORE_FETCH_TIMEOUT", "0"),
           ("PREFILL_TOKEN_WEIGHT", "0"), ("HOST_STORE_BYTES", "-1"), ("TENSOR_PARALLEL", "0"),
           ("LOG_LEVEL", "LOUD"), ("GRAMMAR_MASK_BUDGET_MS", "-1"), ("HANDOFF_PEERS", "10.0.0.1:8100")]


@pytest.mark.parametrize(("name", "value"), REFUSED)
def test_a_refused_environment_value_names_the_variable(monkeypatch, capsys, name, value):
    monkeypatch.setenv(f"EDGEINFER_ARG_{name}", value)
    with pytest.raises(SystemExit) as e:
        parse_args(["--insecure-no-internal-auth"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"EDGEINFER_ARG_{name}=" in err, err
    monkeypatch.delenv(f"EDGEINFER_ARG_{name}")
    flag = "--" + name.lower().replace("_", "-")
    with pytest.raises(SystemExit):
        parse_args(["--insecure-no-internal-auth", flag, value])
    err = capsys.readouterr().err
    assert flag in err and "EDGEINFER_ARG_" not in err.split("error:")[-1], err


def test_a_misspelt_variable_is_refused_not_ignored(monkeypatch, capsys):
    monkeypatch.setenv("EDGEINFER_ARG_SPECULATIV", "off")
    with pytest.raises(SystemExit):
        parse_args(["--insecure-no-internal-auth"])
    err = capsys.readouterr().err
    assert "EDGEINFER_ARG_SPECULATIV: no option" in err and "EDGEINFER_ARG_SPECULATIVE" in err
    monkeypatch.delenv("EDGEINFER_ARG_SPECULATIV")
    monkeypatch.setenv("EDGEINFER_ARG_NODES", "2")      # serve's: its backends inherit its environment
    assert parse_args(["--insecure-no-internal-auth"]).port == 8100


@pytest.mark.parametrize(("name", "value"), [("PORT", "99999"), ("READY_TIMEOUT", "-1"), ("NODES", "0"),
                                             ("BACKEND_PORT", "70000"), ("VALKEY_MAXMEMORY", "5"),
                                             ("PREFILL_NODES", "-1")])
def test_serve_refuses_a_bad_environment_value_naming_it(monkeypatch, capsys, name, value):
    from edgeinfer.ops.serve import main

    monkeypatch.setenv(f"EDGEINFER_ARG_{name}", value)
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and f"EDGEINFER_ARG_{name}=" in capsys.readouterr().err


def test_serve_refuses_a_misspelt_variable(monkeypatch, capsys):
    from edgeinfer.ops.serve import main

    monkeypatch.setenv("EDGEINFER_ARG_PREFIL_NODES", "1")
    with pytest.raises(SystemExit):
        main([])
    assert "EDGEINFER_ARG_PREFIL_NODES: no option" in capsys.readouterr().err
    monkeypatch.delenv("EDGEINFER_ARG_PREFIL_NODES")
    monkeypatch.setenv("EDGEINFER_ARG_MAX_NUM_SEQS", "abc")   # a backend's: serve leaves it to its backends
    monkeypatch.setenv("EDGEINFER_ARG_PORT", "123456")
    with pytest.raises(SystemExit):
        main([])
    assert "EDGEINFER_ARG_PORT='123456'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(("cmd", "env"), [
    (["backend", "--insecure-no-internal-auth"], {"EDGEINFER_ARG_LOG_LEVEL": "LOUD"}),
    (["backend", "--insecure-no-internal-auth"], {"EDGEINFER_ARG_KV_CACHE_BYTES": "-5"}),
    (["gateway"], {"EDGEINFER_LOG_LEVEL": "LOUD"}),
    (["gateway"], {"EDGEINFER_LOG_FORMAT": "xml"}),
    (["serve"], {"EDGEINFER_LOG_FORMAT": "xml"}),
    (["serve"], {"EDGEINFER_LOG_LEVEL": "noisy"}),
])
def test_the_commands_end_with_one_line_not_a_traceback(tmp_path, cmd, env):
    """Through the real `edgeinfer` entry point, as an operator starts it."""
    import os
    import subprocess
    import sys

    full = {**os.environ, "EDGEINFER_HOME": str(tmp_path), **env}
    r = subprocess.run([sys.executable, "-m", "edgeinfer.ops.cli", *cmd], env=full, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and next(iter(env)) in r.stderr, r.stderr
