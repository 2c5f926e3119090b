"""Tokenizer on `tokenizers` + chat templates rendered with jinja2. Torch-free (the gateway uses it)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as _HFTokenizer

if TYPE_CHECKING:
    from jinja2 import Template


class TokenizerError(ValueError):
    pass


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: malformed JSON ({e})") from e


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, config: dict, eos_ids: set[int], source: str = "") -> None:
        self._tok = tok
        self.source = source
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.eos_token_ids = set(eos_ids)
        if self.eos_token is not None and (i := tok.token_to_id(self.eos_token)) is not None:
            self.eos_token_ids.add(i)
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        self._template: Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path, model_vocab_size: int | None = None) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{tj}: missing (edgeinfer needs a `tokenizers` tokenizer.json)")
        try:
            tok = _HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise TokenizerError(f"{tj}: cannot load tokenizer ({e})") from e
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        eos = gen.get("eos_token_id", [])
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        if "chat_template" not in cfg and (path / "chat_template.jinja").is_file():
            cfg["chat_template"] = (path / "chat_template.jinja").read_text()
        if model_vocab_size is not None and tok.get_vocab_size() > model_vocab_size:
            raise TokenizerError(f"{tj}: tokenizer has {tok.get_vocab_size()} tokens but the model's "
                                 f"vocab_size is {model_vocab_size}: tokenizer does not belong to this model")
        return cls(tok, cfg, eos_ids, source=str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def to_json(self) -> str:
        """The tokenizer.json this tokenizer was read from, as text (llguidance builds its token table from it)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: the model has no chat template; use /v1/completions")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))

    def detokenizer(self, prompt_ids: list[int] | None = None) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids or [])


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; holds back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tok
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        full = self.tok.decode(self.ids[self.prefix_offset:])
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
