"""Incremental detokenization: token ids arrive a few at a time, text leaves in valid pieces.

Decoding each new token alone is wrong twice over: byte-level BPE splits one UTF-8 character
across tokens (each half decodes to U+FFFD), and SentencePiece drops a token's leading space when
it starts the decoded string. So, as vLLM does, decode a short window that starts a few tokens back
(`prefix_offset`) and emit only what the window adds beyond the text already emitted
(`read_offset`); while the window ends inside a character (trailing U+FFFD), wait for more tokens.
"""

from __future__ import annotations

from typing import Sequence

from llgtrt_core.tokenizer import Tokenizer

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens seeding the window so the first token decodes in context
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Text completed by these tokens; a character still missing bytes is held back."""
        if not token_ids:
            return ""
        self._token_ids.extend(token_ids)
        emitted = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._token_ids))
        if len(window) <= len(emitted) or window.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return window[len(emitted):]

    def flush(self) -> str:
        """At the end of generation: whatever is held back, even an incomplete character."""
        emitted = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._token_ids))
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return window[len(emitted):]
