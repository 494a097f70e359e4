"""Incremental detokenization: token ids arrive a few at a time, text leaves in valid pieces.

Decoding each new token alone is wrong twice over: byte-level BPE splits one UTF-8 character
across tokens (each half decodes to U+FFFD), and SentencePiece drops a token's leading space when
it starts the decoded string. The `tokenizers` library's `DecodeStream` handles both in Rust, one
call per delta: seeded with the prompt's last tokens so the first token decodes in context, it
returns only the text the new tokens complete and holds back a character still missing bytes.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream

from llgtrt_core.tokenizer import Tokenizer

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens seeding the stream so the first token decodes in context
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            context = []  # a prompt (given as ids) ending inside a character: the stream would emit its tail
        self._stream = DecodeStream(context, skip_special_tokens)
        self._held: list[int] = []  # tokens added since the last text: they end inside a character

    def add(self, token_ids: Sequence[int]) -> str:
        """Text completed by these tokens; a character still missing bytes is held back."""
        if not token_ids:
            return ""
        text = self._stream.step(self._tokenizer.backend, list(token_ids))
        if text is None:
            self._held.extend(token_ids)
            return ""
        self._held = []
        return text

    def flush(self) -> str:
        """At the end of generation: whatever is held back, even an incomplete character."""
        held, self._held = self._held, []
        return self._tokenizer.decode(held, skip_special_tokens=self._skip_special_tokens) if held else ""
