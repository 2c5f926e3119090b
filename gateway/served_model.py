"""Per-model gateway state: the tokenizer (chat template -> ids) and token strings for logprobs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from concurrent.futures.process import BrokenProcessPool
from functools import lru_cache
from pathlib import Path

from edgeinfer.gateway.errors import APIError
from edgeinfer.gateway.prompt_ids import PromptEncoder
from edgeinfer.gateway.schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from edgeinfer.gateway.tokenpool import TokenizerPool, WorkerFailed
from edgeinfer.protocol.defaults import native_default_dir
from edgeinfer.protocol.tokenizer import Tokenizer, TokenizerError
from edgeinfer.protocol.wire import TokenLogprob

_OFFLOAD_CHARS = 8192  # longer prompts are tokenized off the event loop: in `pool`, else in a thread


def resolve_tokenizer_dir(spec: str) -> Path:
    """"default": the built-in model's import (made by `edgeinfer serve` or `edgeinfer model import`; the gateway
    never touches model files itself), else the directory given."""
    if spec == "default":
        path = native_default_dir()
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer \"default\": the built-in model is not imported yet ({path}); run "
                                    "`edgeinfer model import` (or `edgeinfer serve`, which does it on first start)")
        return path
    return Path(spec)


def _template_error(message: str) -> APIError:
    return APIError(400, f"cannot apply the chat template: {message}", code="invalid_messages", param="messages")


class ServedModel:
    def __init__(self, name: str, tokenizer: Tokenizer) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.pool: TokenizerPool | None = None     # set by the app while it runs (gateway/app.py)
        self.token_str = lru_cache(maxsize=65536)(self._token_str)
        self.ids = PromptEncoder(tokenizer)
        self._chat_ids, self._prompt_ids, self._text_ids = self.ids.chat_ids, self.ids.prompt_ids, self.ids.text_ids

    @classmethod
    def load(cls, name: str, tokenizer_spec: str) -> ServedModel:
        return cls(name, Tokenizer.from_dir(resolve_tokenizer_dir(tokenizer_spec)))

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _run(self, fn, arg, kind: str, size: int) -> Sequence[int]:
        """Token ids: a list, or an int32 array from the pool (`.tolist()` once the prompt is accepted)."""
        try:
            if size <= _OFFLOAD_CHARS:
                return fn(arg)
            if self.pool is not None and self.pool.serves(self.name):
                return await self.pool.encode(self.name, kind, arg)
            return await asyncio.to_thread(fn, arg)
        except BrokenProcessPool as e:
            raise APIError(503, "the tokenizer worker died; retry the request", code="tokenizer_unavailable",
                           headers={"retry-after": "1"}) from e
        except WorkerFailed as e:
            if e.tokenizer:
                raise APIError(400, e.message, code="tokenization_failed") from e
            raise _template_error(e.message) from e
        except TokenizerError as e:
            raise APIError(400, str(e), code="tokenization_failed") from e
        except Exception as e:  # jinja2 TemplateError (raise_exception in the template), bad input
            raise _template_error(f"{type(e).__name__}: {e}") from e

    async def encode_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> Sequence[int]:
        size = sum(len(m["content"]) for m in messages)
        payload = (messages, template_kwargs) if template_kwargs else messages
        return await self._run(self._chat_ids, payload, "chat", size)

    async def encode_prompt(self, prompt: str) -> Sequence[int]:
        return await self._run(self._prompt_ids, prompt, "prompt", len(prompt))

    async def encode_text(self, text: str) -> Sequence[int]:
        return await self._run(self._text_ids, text, "text", len(text))

    def check_ids(self, ids: list[int]) -> None:
        vocab = self.tokenizer.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise APIError(400, f"prompt token id {t} is out of range [0, {vocab})", param="prompt",
                               code="invalid_value")

    def chat_logprobs(self, items: list[TokenLogprob]) -> ChatLogprobs:
        out = []
        for lp in items:
            s = self.token_str(lp.token_id)
            top = [TopLogprob(self.token_str(t), v, list(self.token_str(t).encode())) for t, v in lp.top]
            out.append(ChatTokenLogprob(s, lp.logprob, list(s.encode()), top))
        return ChatLogprobs(out)

    def echo_logprobs(self, prompt_ids: list[int], prompt: list[TokenLogprob | None], items: list[TokenLogprob],
                      generated_offset: int) -> CompletionLogprobs:
        """Completions' echo + logprobs: every prompt token (the first one's logprob and top null, as OpenAI and vLLM
        answer; a prompt token's top without alternatives asked is itself), then the generated ones; text offsets
        from the start of the echoed prompt."""
        out = self._completion_logprobs(zip(prompt_ids, prompt, strict=True), 0, chosen_if_no_top=True)
        rest = self.completion_logprobs(items, generated_offset)
        return CompletionLogprobs([*out.tokens, *rest.tokens], [*out.token_logprobs, *rest.token_logprobs],
                                  [*out.top_logprobs, *rest.top_logprobs], [*out.text_offset, *rest.text_offset])

    def completion_logprobs(self, items: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        return self._completion_logprobs(((lp.token_id, lp) for lp in items), offset, chosen_if_no_top=False)

    def _completion_logprobs(self, entries: Iterable[tuple[int, TokenLogprob | None]], offset: int,
                             chosen_if_no_top: bool) -> CompletionLogprobs:
        """(token id, its logprob or None) -> the legacy completions shape, text offsets from `offset`."""
        out = CompletionLogprobs([], [], [], [])
        for tok, lp in entries:
            s = self.token_str(tok)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = {self.token_str(t): v for t, v in lp.top}
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top or ({s: lp.logprob} if chosen_if_no_top else {}))
        return out
