"""Engine logprobs to the OpenAI shapes: chat `logprobs.content[]` and legacy completions'
parallel lists (tokens, token_logprobs, top_logprobs, text_offset).

A token's text is its own decoding; its `bytes` are its exact UTF-8 bytes, which matter for a
byte-level token holding part of a character (its text is then U+FFFD). Logprobs of tokens the
reported distribution excludes (-inf: masked by a constraint, cut by top-k) are sent as -9999.0,
as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import functools
import re
from typing import Optional, Sequence

from llgtrt_core.api.protocol import ChatCompletionTokenLogprob, ChoiceLogprobs, CompletionLogprobs, TopLogprob
from llgtrt_core.engine.interface import TokenLogprob
from llgtrt_core.tokenizer import Tokenizer

_LOWEST_LOGPROB = -9999.0
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's raw-byte tokens
_REPLACEMENT_CHAR = "\ufffd"


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in for each byte, inverted (char -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    return dict(zip(chars, printable + others))


def reported(logprob: float) -> float:
    return max(logprob, _LOWEST_LOGPROB)


@functools.lru_cache(maxsize=4)
def token_texts(tokenizer: Tokenizer) -> TokenTexts:
    """The cache of one tokenizer, shared by every request."""
    return TokenTexts(tokenizer)


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), cached: top_logprobs name the same tokens over and over."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.get = functools.lru_cache(maxsize=65536)(self._text_and_bytes)

    def _text_and_bytes(self, token_id: int) -> tuple[str, bytes]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if _REPLACEMENT_CHAR not in text:
            return text, text.encode("utf-8")
        piece = self._tokenizer.hf.convert_ids_to_tokens(token_id) or ""
        if match := _BYTE_FALLBACK_PIECE.fullmatch(piece):
            return text, bytes([int(match.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return text, bytes(alphabet[c] for c in piece)
        return text, text.encode("utf-8")


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Optional[Sequence[TokenLogprob]]
                  ) -> Optional[ChoiceLogprobs]:
    """A chat choice's (or chunk's) logprobs; None when the request did not ask for them."""
    if logprobs is None:
        return None
    texts = token_texts(tokenizer)

    def top_entry(token_id: int, logprob: float) -> TopLogprob:
        text, raw = texts.get(token_id)
        return TopLogprob(token=text, bytes=list(raw), logprob=reported(logprob))

    content = []
    for token_id, logprob in zip(token_ids, logprobs):
        text, raw = texts.get(token_id)
        content.append(ChatCompletionTokenLogprob(
            token=text, bytes=list(raw), logprob=reported(logprob.logprob),
            top_logprobs=[top_entry(t, lp) for t, lp in logprob.top]))
    return ChoiceLogprobs(content=content)


class CompletionLogprobsBuilder:
    """Legacy completions' logprobs of one choice, piece by piece (streamed or whole).

    text_offset counts characters of the choice's text from its start, echoed prompt included;
    top_logprobs holds the sampled token too (OpenAI: up to logprobs + 1 entries).
    """

    def __init__(self, texts: TokenTexts):
        self._texts = texts
        self._offset = 0

    def add(self, token_ids: Sequence[int], logprobs: Sequence[Optional[TokenLogprob]]) -> CompletionLogprobs:
        piece = CompletionLogprobs(top_logprobs=[])
        for token_id, logprob in zip(token_ids, logprobs):
            text = self._texts.get(token_id)[0]
            piece.tokens.append(text)
            piece.text_offset.append(self._offset)
            self._offset += len(text)
            if logprob is None:  # the first prompt token: nothing before it to predict it
                piece.token_logprobs.append(None)
                piece.top_logprobs.append(None)
                continue
            piece.token_logprobs.append(reported(logprob.logprob))
            top = {self._texts.get(t)[0]: reported(lp) for t, lp in logprob.top}
            top.setdefault(text, reported(logprob.logprob))
            piece.top_logprobs.append(top)
        return piece


def mean_logprob(logprobs: Optional[Sequence[TokenLogprob]]) -> float:
    """Log probability per token of a completion (how best_of ranks candidates)."""
    if not logprobs:
        return float("-inf")
    return sum(lp.logprob for lp in logprobs) / len(logprobs)
