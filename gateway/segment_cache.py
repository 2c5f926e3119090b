"""Tokenize a prompt as the concatenation of cached encodings of the pieces between added tokens.

`tokenizers` itself splits the text at added tokens (<|im_start|>, <|im_end|>, ...) and encodes each
piece on its own, so for a tokenizer whose normalizer and pre-tokenizer do not depend on where a piece
sits in the text, encode(text) == concat(encode(piece)). A chat re-sends its system prompt and history
every turn; those pieces are then dictionary hits. Tokenizers that do not qualify (a normalizer,
Metaspace's "prepend to the first piece", added tokens with lstrip/rstrip/single_word) get None from
`SegmentEncoder.build` and are encoded whole. `build` also checks the identity on a sample.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

_LOCAL_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Split", "Punctuation", "Whitespace", "WhitespaceSplit"}
_LOCAL_MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}
_SAMPLE = ("Hello  world!\n\n{tok}system\nYou are 42 % sure \u00e9t\u00e9 \u4e2d\u6587 \U0001f600{tok}\n{tok}"
           "user\n  tabs\tand 1234567 digits{tok}{tok}\n assistant\n")


def _position_independent(spec: dict) -> bool:
    if spec.get("normalizer") is not None:
        return False
    if (spec.get("model") or {}).get("type") not in _LOCAL_MODELS:
        return False
    pre = spec.get("pre_tokenizer")
    stack = [pre] if pre is not None else []
    while stack:
        p = stack.pop()
        if p.get("type") == "Sequence":
            stack.extend(p.get("pretokenizers", []))
        elif p.get("type") not in _LOCAL_PRE_TOKENIZERS or p.get("add_prefix_space"):
            return False
    return all(not (t.get("lstrip") or t.get("rstrip") or t.get("single_word")) for t in spec.get("added_tokens", []))


class SegmentEncoder:
    def __init__(self, encode: Callable[[str], list[int]], added: dict[str, int], max_chars: int = 4_000_000) -> None:
        self._encode = encode
        self._added = added
        # longest first: at one position the regex then takes the longest added token, like tokenizers does
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")").split
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._max_chars = max_chars
        self._lock = threading.Lock()  # long prompts are tokenized in a worker thread

    @classmethod
    def build(cls, tokenizer_dir: str | Path, encode: Callable[[str], list[int]]) -> SegmentEncoder | None:
        try:
            spec = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
        except (OSError, ValueError):
            return None
        added = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("content")}
        if not added or not _position_independent(spec):
            return None
        seg = cls(encode, added)
        for tok in list(added)[:4]:
            sample = _SAMPLE.format(tok=tok)
            if seg.encode(sample) != encode(sample):
                return None
        seg._cache.clear()
        seg._chars = 0
        return seg

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        cache, added = self._cache, self._added
        for i, piece in enumerate(self._split(text)):
            if i % 2:
                ids.append(added[piece])
            elif piece:
                got = cache.get(piece)
                if got is None:
                    got = self._encode(piece)
                    self._insert(piece, got)
                else:
                    with self._lock:
                        if piece in cache:
                            cache.move_to_end(piece)
                ids += got
        return ids

    def _insert(self, piece: str, ids: list[int]) -> None:
        with self._lock:
            if piece in self._cache:
                return
            self._cache[piece] = ids
            self._chars += len(piece)
            while self._chars > self._max_chars and len(self._cache) > 1:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)
