"""Engine logprobs to the OpenAI shapes: chat `logprobs.content[]` and legacy completions'
parallel lists (tokens, token_logprobs, top_logprobs, text_offset).

A token's `bytes` are its exact bytes, as llguidance's tokenizer holds them (a byte-level or
byte-fallback token may hold part of a UTF-8 character); its text is those bytes decoded, U+FFFD
standing for a partial character. A SentencePiece token keeps its leading space, so token texts
concatenate to the generated text. Logprobs of tokens the reported distribution excludes (-inf:
masked by a constraint, cut by top-k) are sent as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

from llguidance import LLTokenizer

from llgtrt_core.api.protocol import ChatCompletionTokenLogprob, ChoiceLogprobs, CompletionLogprobs, TopLogprob
from llgtrt_core.engine.interface import TokenLogprob
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.tokenizer import Tokenizer

_LOWEST_LOGPROB = -9999.0
_SPECIAL_TOKEN_MARKER = b"\xff"  # llguidance's first byte of a special token; decode_bytes drops it


def reported(logprob: float) -> float:
    return max(logprob, _LOWEST_LOGPROB)


def token_texts(runtime: ModelRuntime) -> TokenTexts:
    """The model's token texts, shared by every request, from the llguidance tokenizer its grammar
    compiler holds (built once per model)."""
    return _token_texts(runtime.grammars.tokenizer, runtime.tokenizer)


@functools.lru_cache(maxsize=4)
def _token_texts(ll_tokenizer: LLTokenizer, tokenizer: Tokenizer) -> TokenTexts:
    return TokenTexts(ll_tokenizer, frozenset(tokenizer.hf.added_tokens_decoder), tokenizer.vocab_size)


class TokenTexts:
    """Token id -> (text, bytes), cached: top_logprobs name the same tokens over and over."""

    def __init__(self, ll_tokenizer: LLTokenizer, added_token_ids: frozenset[int], vocab_size: int):
        self._ll_tokenizer = ll_tokenizer
        self._added_token_ids = added_token_ids
        self._vocab_size = vocab_size  # added tokens included; the logits may be wider (padding)
        self.get = functools.lru_cache(maxsize=65536)(self._text_and_bytes)

    def _text_and_bytes(self, token_id: int) -> tuple[str, bytes]:
        raw = self._ll_tokenizer.decode_bytes([token_id])
        if self._ll_tokenizer.is_special_token(token_id) and token_id not in self._added_token_ids:
            # Not special to the tokenizer: logits padding past its vocabulary (no text), or a
            # token whose first byte is 0xFF (Llama 3's raw byte 0xFF), which decode_bytes drops.
            raw = _SPECIAL_TOKEN_MARKER + raw if token_id < self._vocab_size else b""
        return raw.decode("utf-8", errors="replace"), raw


def chat_logprobs(runtime: ModelRuntime, token_ids: Sequence[int], logprobs: Optional[Sequence[TokenLogprob]]
                  ) -> Optional[ChoiceLogprobs]:
    """A chat choice's (or chunk's) logprobs; None when the request did not ask for them."""
    if logprobs is None:
        return None
    texts = token_texts(runtime)

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
