"""Loop-aware constrained decoding: notice when a constrained answer repeats itself and steer it
out through what the grammar allows, so it ends instead of running to max_tokens.

A small model under a grammar often loops inside what the grammar allows: the same array item
again and again, a phrase inside a string, endless digits. Detection is a rolling check, O(1)
per token: the tail of the tokens is periodic (period p: each token equals the one p back) over
at least `min_span` tokens and `min_repeats` periods. The candidate period is the distance to
the previous occurrence of the token where the last run broke, so a loop of any period is found
without trying every period.

Steering never leaves the grammar: the row's mask is ANDed with a class of tokens that end
things (`EscapeMasks`), and only when that leaves something allowed; otherwise it waits for a
step where it does. The fill narrows a looping row's host mask (`steer_loops`); a row near
its length limit (below) is marked `closing` on its constraint, and the post-processor narrows
its mask where it uploads the masks (on a GPU, one CUDA kernel after the copy: on their last
steps every row of a batch may be near its limit, docs/benchmarks/engine.md "Session 30").
A loop inside a string or a number (no JSON punctuation in its period) is left by one token
that ends the value (`"`, `,`, `]`, `}` or EOS, alone or together); a loop over items or keys
by one that closes a container (`]`, `}`, maybe after a `"`) or EOS. Once a steered token is
taken the guard watches again from scratch.

What no period check sees (items that differ a little each time, a recursion that opens the same
object again, a string that never closes, an array of ever new items) is caught by the length
limit: once the tokens left of `max_tokens` are `closing_margin` (at most a tenth of
`max_tokens`) plus one per bracket open outside strings, every
step is steered the way a value loop is left, to the nearest ending the grammar allows (close
the string, then the containers, `,` only where a required key or item must come first), so
the document closes before the limit. An answer that never repeats that long and ends before
that point is never touched: its masks are the grammar's own.
"""

from __future__ import annotations

import itertools
import operator
import sys
from typing import Optional, Sequence

import numpy as np
import torch

from llgtrt_core.engine.interface import ConstrainedRow, LoopGuardSettings

_WORD_SAMPLE = 16  # mask words tried first when asking whether a row is inside a string
OUTSIDE, IN_STRING, AFTER_BACKSLASH = 0, 1, 2  # where a JSON text stands, for `EscapeMasks.count_open`
_PUNCTUATION = frozenset('"{}[],:')  # a period holding one of these repeats JSON items or keys
_VALUE_ENDERS = frozenset('"]},')  # characters of the tokens that end a value
_CONTAINER_CLOSERS = frozenset("]}")


class LoopGuard:
    """One sequence's rolling loop check. Plain state (picklable); `observe` is O(1) amortized."""

    __slots__ = ("settings", "tokens", "_last_seen", "_period", "_run", "escaping", "_structural", "_depth",
                 "_floor", "_seen", "closing", "_open", "_string", "_counted", "_check_at")

    def __init__(self, settings: LoopGuardSettings = LoopGuardSettings()) -> None:
        self.settings = settings
        self.tokens: list[int] = []  # every token committed so far (generated, forced included)
        self._last_seen: dict[int, int] = {}  # token -> its latest position
        self._period = 0  # candidate period of the current run (0: none)
        self._run = 0  # tokens in a row equal to the one `_period` back
        self.escaping = False  # a loop was found and no steered token was taken yet
        # The loop repeats items or keys (its period holds JSON punctuation); None: not decided yet.
        self._structural: Optional[bool] = None
        # While escaping a loop over items or keys: the bracket depth now and the loop's lowest,
        # both relative to where the loop was found, and the tokens counted in `_depth` so far.
        self._depth = self._floor = self._seen = 0
        self.closing = False  # the length limit is near: every step steers to the nearest ending
        # Brackets open outside strings over the first `_counted` tokens, and where those end
        # (`EscapeMasks.count_open`'s state: outside a string, inside, inside after a backslash).
        self._open, self._string, self._counted = 0, OUTSIDE, 0
        self._check_at = 0  # `near_limit` is False for fewer tokens than this (known without counting)

    def observe(self, token: int) -> None:
        position = len(self.tokens)
        period = self._period
        if period and self.tokens[position - period] == token:
            self._run += 1
        else:
            previous = self._last_seen.get(token)
            self._period = 0 if previous is None else position - previous
            self._run = 0 if previous is None else 1
        self._last_seen[token] = position
        self.tokens.append(token)
        if not self.escaping and self._run >= max(self.settings.min_span - self._period,
                                                  (self.settings.min_repeats - 1) * self._period):
            self.escaping = True
            self._structural = None  # decided by `steering`, which knows the token texts

    def steers(self, token: Optional[int], escapes: "EscapeMasks") -> bool:
        """Observe the step's committed token (None: none) and say whether this step steers the
        row's mask: it escapes a loop or is near its limit."""
        if token is not None:
            self.observe(token)
        return self.near_limit(escapes) or self.escaping  # the limit first: an escape may never end

    def observe_all(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.observe(token)

    def near_limit(self, escapes: "EscapeMasks") -> bool:
        """Whether the tokens left of `max_tokens` are down to the margin plus the open brackets
        (from then on, for good). O(1) amortized: brackets are counted once per token, and only
        once the tokens not counted yet could have opened enough of them to matter."""
        if self.closing:
            return True
        if len(self.tokens) < self._check_at:
            return False
        limit = self.settings.max_tokens
        if limit is None:
            self._check_at = sys.maxsize
            return False
        # A short answer keeps most of its room: the margin is at most a tenth of it.
        margin = min(self.settings.closing_margin, limit // 10)
        left, uncounted = limit - len(self.tokens), len(self.tokens) - self._counted
        room = left - margin - max(self._open, 0) - escapes.most_opened * uncounted
        if room > 0:
            # Each token takes one from `left` and may open `most_opened` brackets: the room lasts
            # for the next ceil(room / (1 + most_opened)) - 1 tokens at least.
            self._check_at = len(self.tokens) + -(-room // (1 + escapes.most_opened))
            return False
        self._open, self._string = escapes.count_open(self.tokens[self._counted:], self._open, self._string)
        self._counted = len(self.tokens)
        self.closing = left <= margin + max(self._open, 0)
        return self.closing

    def period_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self._period:]

    def steering(self, escapes: "EscapeMasks") -> Optional[bool]:
        """A row escaping a loop (not near its limit), before its mask is steered: whether the loop
        is over items or keys, or None when this step steers nothing (the container the loop ran
        in closed)."""
        if self._structural is None:
            self._start_escape(escapes)
        if self._structural:
            self._depth += sum(escapes.depth_delta[t] for t in self.tokens[self._seen:])
            self._seen = len(self.tokens)
            if self._depth < self._floor:
                self._stop_escape()
                return None
        return bool(self._structural)

    def steered(self, narrowed: bool, structural: bool) -> None:
        """After the mask was steered (narrowed: to an escape class; not: none is allowed here, the
        next step tries again). A loop in a value is over once a token ending the value is taken;
        a loop over items or keys once its container is closed (`steering` sees that)."""
        if narrowed and not structural:
            self._stop_escape()

    def _start_escape(self, escapes: "EscapeMasks") -> None:
        period = self.period_tokens()
        self._structural = escapes.is_structural(period)
        depth = floor = 0
        for token in reversed(period):  # depths before each period token, relative to now
            depth -= escapes.depth_delta[token]
            floor = min(floor, depth)
        self._depth, self._floor, self._seen = 0, floor, len(self.tokens)

    def _stop_escape(self) -> None:
        self.escaping = False
        self._structural = None
        self._period = self._run = 0


class EscapeMasks:
    """Per tokenizer: the token classes steering uses, as int32 mask rows (bit t%32 of word t//32).

    Whether a row is inside a JSON string is read off its mask: only there does the grammar
    allow plain words. Inside, a value ends with a token opening with the closing quote
    (`"`, `",`, `"]`, `"}`, ...); outside, with `,`, `]`, `}` (made of these only) or EOS. Free
    text (a reasoning section before the answer, a grammar's free-text rule) allows words and a
    raw newline, which no JSON string does: there nothing is steered.
    """

    def __init__(self, token_texts: Sequence[str], eos_tokens: Sequence[int], words: int) -> None:
        self._texts = token_texts
        stripped = [text.strip() for text in token_texts]
        string_enders = [t for t, text in enumerate(stripped)
                         if text[:1] == '"' and _made_of(text[1:], _VALUE_ENDERS - {'"'})]
        value_enders = [t for t, text in enumerate(stripped) if text and _made_of(text, _VALUE_ENDERS - {'"'})]
        # Brackets opened minus closed by each token (inside strings too: close enough for a loop;
        # the length limit counts outside strings, `count_open`).
        self.depth_delta = [text.count("{") + text.count("[") - text.count("}") - text.count("]")
                            for text in token_texts]
        # Brackets one token may open, at most (outside a string or after closing one).
        self.most_opened = max((text.count("{") + text.count("[") for text in token_texts), default=0)
        self.words = _mask_row([t for t, text in enumerate(token_texts) if _is_word(text)], words)
        # The mask words holding the most word tokens: a row inside a string allows one of them
        # unless a pattern narrows its words, so most rows are settled without reading the rest.
        self._word_sample = np.sort(np.argsort(_popcounts(self.words), kind="stable")[-_WORD_SAMPLE:])
        self.newlines = _mask_row([t for t, text in enumerate(token_texts) if "\n" in text], words)
        string_closers = [t for t in string_enders if _CONTAINER_CLOSERS & set(stripped[t])]
        container_closers = [*(t for t in value_enders if "," not in stripped[t]), *eos_tokens]
        # The escape classes by index, in the orders `_classes_to_try` gives: each a few dozen
        # tokens. Kept as the mask words that hold any of them (`class_words`) and, per class, its
        # bits in those words (`class_bits`, one row a class): one array op tests every class.
        classes = np.stack([_mask_row(container_closers, words), _mask_row([*value_enders, *eos_tokens], words),
                            _mask_row(string_closers, words), _mask_row(string_enders, words)])
        self.class_words = np.flatnonzero(classes.any(0))
        self.class_bits = np.ascontiguousarray(classes[:, self.class_words])  # a strided copy made the AND 6x slower
        self._string_order, self._container_order, self._value_loop_order = (2, 3), (0,), (0, 1, 2, 3)

    @classmethod
    def for_tokenizer(cls, ll_tokenizer, words: int) -> "EscapeMasks":
        return cls(token_texts(ll_tokenizer), ll_tokenizer.eos_tokens, words)

    def count_open(self, tokens: Sequence[int], depth: int, state: int) -> tuple[int, int]:
        """`depth` plus the brackets `tokens` open minus those they close outside JSON strings, and
        the state after them, from `state`. The length limit's count: a `}` a model writes inside a
        string closes nothing, and counted as closed it left the answer no room to finish."""
        for token in tokens:
            text = self._texts[token] if token < len(self._texts) else ""
            if state == OUTSIDE and '"' not in text:
                depth += self.depth_delta[token] if text else 0  # no text: a token past the texts
                continue
            if state == IN_STRING and '"' not in text and "\\" not in text:
                continue
            for char in text:
                if state == AFTER_BACKSLASH:
                    state = IN_STRING
                elif state == IN_STRING:
                    state = OUTSIDE if char == '"' else AFTER_BACKSLASH if char == "\\" else IN_STRING
                elif char == '"':
                    state = IN_STRING
                elif char in "{[":
                    depth += 1
                elif char in "}]":
                    depth -= 1
        return depth, state

    def is_structural(self, tokens: Sequence[int]) -> bool:
        return any(_PUNCTUATION & set(self._texts[t]) for t in tokens if t < len(self._texts))

    def narrow(self, masks: torch.Tensor, rows: Sequence[int], structural: Sequence[bool]) -> list[bool]:
        """Narrow each host mask masks[rows[i]] in place to the first escape class the grammar
        allows a token of there; whether it was. One batch of array ops over all the rows and every
        class, on the few mask words the classes hold: near the length limit every row steers every
        step. numpy, single-threaded: a torch op this large would start an OpenMP team, which stalls
        at its barrier on cores the mask fill's threads hold."""
        host = masks.numpy()
        rows = list(rows)
        # A run of rows is a view. The words test reads a sample of each mask first, the newline
        # test the masks of rows inside a string only (no other row reads it).
        selected = host[rows[0]:rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else host[rows]
        in_string = _any_common_bit(selected, self.words, self._word_sample)  # or free text
        free_text = [False] * len(rows)
        inside = [i for i, string in enumerate(in_string) if string]
        if inside:
            for i, free in zip(inside, _any_common_bit(selected if len(inside) == len(rows) else selected[inside],
                                                       self.newlines)):
                free_text[i] = free
        orders = [self._classes_to_try(string, free, loop_over_items)
                  for string, free, loop_over_items in zip(in_string, free_text, structural)]
        # Per row and class, whether the mask allows a token of it: one AND over the classes' words.
        words = selected[:, self.class_words]
        allows = np.bitwise_and(words[:, None, :], self.class_bits).any(2).tolist()
        chosen = [next((escape for escape in order if row_allows[escape]), None)
                  for order, row_allows in zip(orders, allows)]
        narrowed = [escape is not None for escape in chosen]
        steered = [i for i, escape in enumerate(chosen) if escape is not None]
        if steered:
            # Every read is done: `selected` may be a view of the rows written now.
            kept = np.array([rows[i] for i in steered])
            kept_words = words[steered] & self.class_bits[[chosen[i] for i in steered]]
            host[kept] = 0
            host[kept[:, None], self.class_words] = kept_words
        return narrowed

    def narrow_to_endings(self, masks: torch.Tensor, rows: Sequence[int]) -> None:
        """`narrow` for rows near their length limit (the nearest ending, as out of a value loop);
        on a GPU the upload runs the same as a kernel (`ending_tables`)."""
        self.narrow(masks, rows, [False] * len(rows))

    def ending_tables(self) -> tuple[np.ndarray, int]:
        """What the CUDA kernel narrowing rows near their length limit reads (`kernels.narrow_to_endings`,
        the GPU's `narrow` for a row that loops over no items): (2 + classes, words) int32 rows, the
        word tokens, the newline tokens, then each class's tokens; and a bit per class a row inside
        a string may take. The kernel takes the first class allowed in index order, which is
        `_classes_to_try`'s order for such a row, inside a string and outside."""
        assert list(self._value_loop_order) == list(range(len(self.class_bits)))
        assert list(self._string_order) == sorted(self._string_order)
        classes = np.zeros((len(self.class_bits), len(self.words)), dtype=np.int32)
        classes[:, self.class_words] = self.class_bits
        return np.concatenate([self.words[None], self.newlines[None], classes]), sum(1 << c for c in self._string_order)

    def _classes_to_try(self, in_string: bool, free_text: bool, loop_over_items: bool) -> tuple[int, ...]:
        """Indices into `_class_rows`, in order. Inside a string (only there does the grammar allow
        plain words), its closing quote; in free text (words and a raw newline, which no JSON
        string allows) nothing. Outside, a loop over items or keys ends by closing its container;
        a loop in a value with any value ending (a number ends with `,` `]` `}`; a string whose
        pattern forbids words, so it looked like no string, with its closing quote)."""
        if in_string:
            return () if free_text else self._string_order
        return self._container_order if loop_over_items else self._value_loop_order


def token_texts(ll_tokenizer) -> list[str]:
    """Each token's text (bytes that are no whole UTF-8 text read as replacement characters)."""
    return [ll_tokenizer.decode_bytes([t]).decode("utf-8", errors="replace") for t in range(ll_tokenizer.vocab_size)]


Steering = list[tuple[int, LoopGuard, bool]]  # (index in the step's rows, its guard, loop over items or keys)


def loop_steering(rows: Sequence[ConstrainedRow], escapes: EscapeMasks) -> Steering:
    """Each guarded row observes the token it committed; the rows whose masks this step steers out
    of a loop. A row near its length limit is marked `closing` on its constraint instead (for good:
    its masks are narrowed where they are uploaded). It reads no mask, so the fill runs it while
    llguidance computes the masks. A row without a guard costs one lookup."""
    steering: Steering = []
    for j, row in enumerate(rows):
        constraint = row.constraint
        guard = constraint.loop_guard  # type: ignore[attr-defined]
        if guard is None or constraint.error is not None or not guard.steers(row.new_token, escapes):
            continue
        if guard.closing:
            constraint.closing = True  # type: ignore[attr-defined]
            continue
        structural = guard.steering(escapes)
        if structural is not None:
            steering.append((j, guard, structural))
    return steering


_CLOSING = operator.attrgetter("constraint.closing")


def closing_positions(rows: Sequence[ConstrainedRow]) -> list[int]:
    """The positions of the rows near their length limit, marked by `loop_steering` (a C-level
    pass: every upload's)."""
    return list(itertools.compress(range(len(rows)), map(_CLOSING, rows)))


def steer_loops(rows: Sequence[ConstrainedRow], masks: torch.Tensor, steering: Steering, escapes: EscapeMasks) -> None:
    """Steer the host masks (masks[j] for rows[j]) of `loop_steering`'s rows, in one batch; not
    those of rows that failed since (their mask allows EOS only)."""
    steering = [entry for entry in steering if rows[entry[0]].constraint.error is None]
    if not steering:
        return
    narrowed = escapes.narrow(masks, [j for j, _, _ in steering], [structural for _, _, structural in steering])
    for (_, guard, structural), done in zip(steering, narrowed):
        guard.steered(done, structural)


def _any_common_bit(rows: np.ndarray, mask: np.ndarray, sample: Optional[np.ndarray] = None) -> list[bool]:
    """Per row of `rows`, whether it shares a bit with `mask`; with `sample` (some of the mask's
    words), first on those words alone, then in full only for the rows they did not settle."""
    if sample is None:
        return np.bitwise_and(rows, mask).any(1).tolist()
    common = np.bitwise_and(rows[:, sample], mask[sample]).any(1)
    unsettled = np.flatnonzero(~common)
    if unsettled.size == len(common):  # none settled: no copy of the rows
        return _any_common_bit(rows, mask)
    if unsettled.size:
        common[unsettled] = np.bitwise_and(rows[unsettled], mask).any(1)
    return common.tolist()


def _popcounts(row: np.ndarray) -> np.ndarray:
    """Bits set in each word of a mask row."""
    return np.unpackbits(row.view(np.uint8)).reshape(len(row), 32).sum(1)


def _made_of(text: str, chars: frozenset) -> bool:
    return set(text) <= chars


def _is_word(text: str) -> bool:
    """Letters only (two or more, maybe after a space) and no part of true / false / null: JSON
    allows such a token only inside a string."""
    word = text[1:] if text[:1] == " " else text
    return len(word) >= 2 and word.isascii() and word.isalpha() and not any(
        word in literal for literal in ("true", "false", "null"))


def _mask_row(tokens: Sequence[int], words: int) -> np.ndarray:
    values = [0] * words
    for token in tokens:
        if token // 32 < words:
            values[token // 32] |= 1 << (token % 32)
    return np.array([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=np.int32)
