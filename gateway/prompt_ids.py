"""Text -> token ids for one model: the chat template and the plain prompt, with the segment cache in front of the
tokenizer (gateway/segment_cache.py). Used in the gateway process (gateway/served_model.py) and in the tokenizer
workers (gateway/tokenpool.py), which import this and nothing above it."""

from __future__ import annotations

from edgeinfer.gateway.segment_cache import SegmentEncoder
from edgeinfer.protocol.tokenizer import Tokenizer


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        seg = SegmentEncoder.build(tokenizer.source, tokenizer.encode) if tokenizer.source else None
        self._encode_text = seg.encode if seg is not None else tokenizer.encode

    def chat_ids(self, payload: list[dict] | tuple[list[dict], dict]) -> list[int]:
        """payload: the messages, or (messages, chat_template_kwargs): extra variables for the template
        (vLLM's chat_template_kwargs, e.g. enable_thinking)."""
        messages, extra = payload if isinstance(payload, tuple) else (payload, {})
        return self._encode_text(self.tokenizer.apply_chat_template(messages, **extra))

    def text_ids(self, text: str) -> list[int]:
        """The text alone: no BOS, no template (/tokenize with add_special_tokens false)."""
        return self.tokenizer.encode(text)

    def prompt_ids(self, prompt: str) -> list[int]:
        ids = self._encode_text(prompt)
        tok = self.tokenizer
        if tok.add_bos and tok.bos_token_id is not None:
            ids = [tok.bos_token_id, *ids]
        return ids
