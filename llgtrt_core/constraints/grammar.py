"""Grammar compilation: validate with llguidance off the event loop, cache by grammar text,
hand out a fresh matcher per request.

Compiling a grammar means building an `LLMatcher` for the model's tokenizer: that validates
it (within the parser limits) and builds its lexer, which is the costly part. The compiled
matcher is never advanced; each request gets a `deep_copy` of it (microseconds), which shares its
lexer: once that lexer fails (out of its limits), the grammar is compiled afresh (`SharedLexer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from llgtrt_core import metrics
from llgtrt_core.constraints.errors import GrammarRequestError
from llgtrt_core.constraints.loop_guard import LoopGuard, LoopGuardSettings
from llgtrt_core.constraints.mask_probe import probe_cost, probe_grammar
from llgtrt_core.constraints.request_grammar import (NumberBounds, RequestGrammar, grammar_for_request,
                                                       request_grammar)

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarConstraint",
    "GrammarRequestError",
    "GrammarText",
    "build_ll_tokenizer",
    "grammar_for_request",
    "parser_limits",
    "request_grammar",
]

if TYPE_CHECKING:
    from llgtrt_core.config import LlguidanceConfig

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 4000  # llguidance's messages can quote a whole grammar; keep 400 bodies sane
LEXER_ERROR = "lexer error"  # how llguidance's messages begin when the lexer itself failed
# llguidance's lexer failures, and the limit each one passed
LEXER_LIMITS = {"too many expressions constructed": "its work for one token passed llguidance.limits.step_lexer_fuel "
                                                    "(a string `pattern` with a large `maxLength` can)",
                "too many states": "its states passed llguidance.limits.max_lexer_states"}


def build_ll_tokenizer(
    hf_tokenizer: Any,
    vocab_size: Optional[int] = None,
    eos_token_ids: Optional[Sequence[int]] = None,
) -> LLTokenizer:
    """The llguidance tokenizer of a model: build it once per model (~1 s for 128k tokens).

    `vocab_size` is the model's logits width: when it exceeds the tokenizer's, the padded
    ids exist in every mask and are never allowed. `eos_token_ids` are the tokens a finished
    grammar allows (default: the tokenizer's EOS); the engine must stop on them.
    """
    import llguidance.hf  # imports transformers: only when a model is loaded

    eos = list(eos_token_ids) if eos_token_ids else None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


def parser_limits(config: Union[LLParserLimits, Mapping[str, Any], None] = None) -> LLParserLimits:
    """LLParserLimits from a config mapping (keys as LLParserLimits' arguments).

    Errors are short by default (`verbose_errors` false): they go back to API clients, and
    the verbose form quotes parser state and the whole grammar.
    """
    if isinstance(config, LLParserLimits):
        return config
    options = {"verbose_errors": False, **(config or {})}
    return LLParserLimits(**options)


class MaskCost:
    """What the probe found of a grammar's masks, shared by every request's matcher of it; a grammar
    not probed (yet, or ever) counts as fast."""

    __slots__ = ("slow",)
    # Whether any grammar of this process was marked slow: until one is, a step need not ask each row.
    any_slow = False

    def __init__(self) -> None:
        self.slow = False  # its masks take `llguidance.slow_mask_ms` or more: its rows are filled apart from the batch

    def mark_slow(self) -> None:
        self.slow = MaskCost.any_slow = True


class SharedLexer:
    """The lexer every copy of one compiled grammar shares (`LLMatcher.deep_copy` does not copy it).
    Out of fuel or states it fails for good, and every copy with it at its next token: so a grammar
    whose lexer failed is not handed out again but compiled afresh (`GrammarCompiler`)."""

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed = False


@dataclass(frozen=True)
class CompiledGrammar:
    grammar: str
    matcher: LLMatcher = field(repr=False)  # template at the start state; never advanced
    warnings: tuple[str, ...] = ()
    # The tokens it forces before anything is sampled (a JSON schema's `{"`), found once here
    # rather than for every request as it is admitted; None: not known.
    start_forced: Optional[tuple[int, ...]] = None
    mask_cost: MaskCost = field(default_factory=MaskCost, repr=False, compare=False)
    lexer: SharedLexer = field(default_factory=SharedLexer, repr=False, compare=False)


class GrammarText:
    """A request's grammar as an engine in another process takes it (the embedded engine's core
    compiles and runs it there): the text, the request field it came from and the error the engine
    reports; implements the engine's `Constraint` protocol."""

    __slots__ = ("grammar", "param", "error")

    def __init__(self, grammar: str = "", param: Optional[str] = None) -> None:
        self.grammar = grammar
        self.param = param  # named in the 400 when the grammar does not compile or fails mid-generation
        self.error: Optional[str] = None  # a plain attribute: read for every row of every step

    def fail(self, message: str) -> None:
        """Record the first error only; the request ends with it."""
        if self.error is None:
            self.error = message[:MAX_ERROR_CHARS] or "grammar error"


class GrammarConstraint(GrammarText):
    """One request's matcher state, for an engine in this process."""

    __slots__ = ("matcher", "loop_guard", "start_forced", "mask_cost", "lexer", "closing")

    def __init__(self, matcher: LLMatcher, grammar: str = "", param: Optional[str] = None,
                 loop_guard: Optional[LoopGuard] = None, start_forced: Optional[tuple[int, ...]] = None,
                 mask_cost: Optional[MaskCost] = None, lexer: Optional[SharedLexer] = None) -> None:
        super().__init__(grammar, param)
        self.matcher = matcher
        self.start_forced = start_forced  # CompiledGrammar.start_forced, while the matcher is at its start
        self.loop_guard = loop_guard  # steers the answer out of a loop (constraints/loop_guard.py)
        self.mask_cost = mask_cost or MaskCost()  # its grammar's, once probed
        self.lexer = lexer or SharedLexer()  # its grammar's
        # Near its length limit (its loop guard's `closing`, for good): the post-processor narrows its
        # masks where it uploads them. A plain attribute: read for every row of every upload.
        self.closing = False

    def fail(self, message: str) -> None:
        """A lexer's failure is its grammar's from now on (`SharedLexer`); the message names the limit."""
        lexer_failure = _lexer_failure(message) if self.error is None else None
        if lexer_failure is not None:
            self.lexer.failed = True
            message = lexer_failure
        super().fail(message)


def _lexer_failure(message: str) -> Optional[str]:
    """llguidance's message if its lexer failed (None if not), with the limit it passed (the config key
    to raise) where known; once (the engine process hears of a row's failure in the fill process as
    that process worded it)."""
    if not message.startswith(LEXER_ERROR):
        return None
    first_line = message.split("\n", 1)[0]
    for failure, limit in LEXER_LIMITS.items():
        if failure in first_line and limit not in first_line:
            return f"{first_line}: {limit}"
    return message


def _first_mask_error(message: str) -> str:
    """llguidance's reason, made readable where it is only a name."""
    if "NoExtensionBias" in message:  # no token can start an output: the grammar matches nothing
        return ("the constraint admits no output at all (a $ref or rule that only refers to itself, or "
                f"one with nothing in it, matches nothing); llguidance: {message}")
    return message


@dataclass(frozen=True)
class _Failure:
    message: str


class GrammarCompiler:
    """Compiles grammars for one tokenizer, with a cache shared by every thread that calls it."""

    def __init__(
        self,
        ll_tokenizer: LLTokenizer,
        limits: Union[LLParserLimits, Mapping[str, Any], None] = None,
        cache_size: int = 256,
        max_workers: Optional[int] = None,
        log_level: int = 0,
        json_whitespace_flexible: bool = False,
        on_miss: Optional[Callable[[str], None]] = None,
        loop_guard: LoopGuardSettings = LoopGuardSettings(),
        loop_guard_by_default: bool = True,
        number_bounds: Optional[NumberBounds] = None,
        slow_mask_s: Optional[float] = None,
        max_grammar_chars: int = 0,
    ) -> None:
        """on_miss(grammar): called when a grammar's compile starts (the service tells the engine
        process, which compiles it too, so that both compiles run at once). compiled_by_engine: the
        engine compiles every request's grammar in its own process (`constraint`). slow_mask_s: each
        new grammar's masks are probed in the background, and a mean past this marks it slow
        (`MaskCost`) and is logged as a warning (constraints/mask_probe.py), unless the engine
        compiles in its own process, which probes; None (a compiler outside the server, e.g. a
        benchmark's): no probe. max_grammar_chars: a request's grammar text may be this long at most
        (0: any length; `constraint`)."""
        self.tokenizer = ll_tokenizer
        self.json_whitespace_flexible = json_whitespace_flexible  # server default for JSON schemas
        self.loop_guard = loop_guard
        self.loop_guard_by_default = loop_guard_by_default  # for requests that do not say
        self.number_bounds = number_bounds  # server default for JSON schemas; None: off
        self.limits = parser_limits(limits)
        self.cache_size = cache_size
        self.log_level = log_level  # llguidance's stderr logging: 0 silent, 1 warnings
        self.on_miss = on_miss
        self.slow_mask_s = slow_mask_s
        self.max_grammar_chars = max_grammar_chars
        self.compiled_by_engine = False
        self._cache: OrderedDict[str, Union[CompiledGrammar, _Failure]] = OrderedDict()
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()  # the cache and the pending compiles
        # LLMatcher construction drops the GIL: a few threads compile in parallel.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers or min(4, os.cpu_count() or 1), thread_name_prefix="grammar"
        )
        # Probes walk in the background, one at a time, on a thread of their own: a compile (a
        # request waiting for its first token) never queues behind one (the slowest take ~0.3 s).
        self._probes = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-probe")

    @classmethod
    def from_config(cls, ll_tokenizer: LLTokenizer, guidance: "LlguidanceConfig") -> "GrammarCompiler":
        """The compiler the `llguidance` config section describes (the serving and engine processes each
        build one), probing new grammars for slow masks."""
        bounds = guidance.number_bounds
        return cls(ll_tokenizer, limits=dataclasses.asdict(guidance.limits), cache_size=guidance.grammar_cache_size,
                   max_workers=guidance.compile_threads, log_level=guidance.log_level,
                   json_whitespace_flexible=guidance.whitespace_flexible,
                   loop_guard=LoopGuardSettings(guidance.loop_guard.min_span, guidance.loop_guard.min_repeats,
                                                guidance.loop_guard.closing_margin),
                   loop_guard_by_default=guidance.loop_guard.enabled,
                   number_bounds=(NumberBounds(bounds.integer_digits, bounds.fraction_digits) if bounds.enabled
                                  else None),
                   slow_mask_s=None if guidance.slow_mask_ms is None else guidance.slow_mask_ms / 1e3,
                   max_grammar_chars=guidance.max_grammar_chars)

    async def compile(self, grammar: str, param: str = "response_format") -> CompiledGrammar:
        """Validate and compile in a worker thread, or answer from the cache.

        Raises GrammarRequestError(param, llguidance's message) when the grammar is invalid
        or over the limits.
        """
        future = self.compile_future(grammar)
        if future.done():  # a cache hit answers without a trip through the event loop, which under load
            return self.checked(future.result(), param)  # queued the request behind every other's work
        # Shielded: one waiter's cancellation must not cancel the compile others share.
        return self.checked(await asyncio.shield(asyncio.wrap_future(future)), param)

    def compile_future(self, grammar: str) -> concurrent.futures.Future:
        """The compile's future (done at once on a cache hit), from any thread; one compile per text
        however many requests wait on it. Its result goes through `checked`."""
        with self._lock:
            result = self._cache.get(grammar)
            if isinstance(result, CompiledGrammar) and result.lexer.failed:
                del self._cache[grammar]  # every copy of it would fail at its next token: compile afresh
                result = None
            if result is not None:
                self._cache.move_to_end(grammar)
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_result(result)
                return future
            future = self._pending.get(grammar)
            if future is None:
                future = self._pending[grammar] = self._pool.submit(self._build, grammar)
                started = True
            else:
                started = False
        if started and self.on_miss is not None:
            self.on_miss(grammar)
        return future

    @staticmethod
    def checked(result: Union[CompiledGrammar, _Failure], param: str) -> CompiledGrammar:
        if isinstance(result, _Failure):
            raise GrammarRequestError(param, result.message)
        return result

    def request_grammar(self, request: Any) -> Optional[RequestGrammar]:
        """The grammar the request's own fields ask for, under this server's JSON defaults; None
        when its output is free. GrammarRequestError -> 400. A big schema takes a while (its copy
        and text): call it off the event loop."""
        return request_grammar(request, self.json_whitespace_flexible, self.number_bounds)

    async def constraint(self, grammar: str, param: str, loop_guard: Optional[LoopGuardSettings] = None
                         ) -> GrammarText:
        """A request's fresh constraint: compiled (GrammarRequestError -> 400), or only the text
        when the engine compiles it in its own process and refuses it there (compiling here too
        held each request back until every API worker had compiled its grammar once). A text past
        `max_grammar_chars` is refused before either: it would be parsed holding the GIL and kept
        in both caches."""
        self.check_length(grammar, param)
        if self.compiled_by_engine:
            return GrammarText(grammar, param)
        return self.new_constraint(await self.compile(grammar, param), param, loop_guard=loop_guard)

    def check_length(self, grammar: str, param: str) -> None:
        """GrammarRequestError when `grammar` is longer than `max_grammar_chars`."""
        if self.max_grammar_chars and len(grammar) > self.max_grammar_chars:
            raise GrammarRequestError(param, f"the grammar built from it has {len(grammar)} characters, more than "
                                             f"this server's {self.max_grammar_chars} (llguidance.max_grammar_chars)")

    def loop_guard_for(self, request: Any, max_tokens: Optional[int] = None) -> Optional[LoopGuardSettings]:
        """The request's `loop_guard` (true / false / null: the server default) for an answer of at
        most `max_tokens`; None when off."""
        wanted = getattr(request, "loop_guard", None)
        if not (self.loop_guard_by_default if wanted is None else wanted):
            return None
        return dataclasses.replace(self.loop_guard, max_tokens=max_tokens)

    def new_constraint(self, compiled: CompiledGrammar, param: Optional[str] = None, *,
                       loop_guard: Optional[LoopGuardSettings] = None) -> GrammarConstraint:
        guard = LoopGuard(loop_guard) if loop_guard is not None else None
        return GrammarConstraint(compiled.matcher.deep_copy(), compiled.grammar, param, guard, compiled.start_forced,
                                 compiled.mask_cost, compiled.lexer)

    def close(self) -> None:
        for pool in (self._pool, self._probes):
            pool.shutdown(wait=False, cancel_futures=True)

    def _build(self, grammar: str) -> Union[CompiledGrammar, _Failure]:
        start = time.perf_counter()
        try:
            result = self._compile(grammar)
        finally:
            metrics.grammar_compile_time.observe(time.perf_counter() - start)
        with self._lock:
            self._pending.pop(grammar, None)
            self._cache[grammar] = result
            self._cache.move_to_end(grammar)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if isinstance(result, CompiledGrammar) and self.slow_mask_s is not None and not self.compiled_by_engine:
            try:
                self._probes.submit(self._probe, result)
            except RuntimeError:  # closed meanwhile
                pass
        return result

    def _probe(self, compiled: CompiledGrammar) -> None:
        """Mark a grammar whose masks are slow, and say so: the engine fills its rows apart from the
        batch's, and its requests' tokens come slower than the others' (a step does not wait for them)."""
        try:
            walk = probe_grammar(compiled.matcher, compiled.grammar, self.tokenizer.eos_tokens)
        except Exception:  # llguidance refusing a step: the request that takes it finds out
            logger.debug("mask probe failed", exc_info=True)
            return
        lexer_failure = _lexer_failure(walk.error) if walk.error is not None else None
        if lexer_failure is not None:
            compiled.lexer.failed = True  # the probe's walk broke the lexer the requests' copies share
            logger.warning("a grammar's lexer failed on the probe's walk (%s): its next request compiles it afresh; "
                           "the grammar begins %r", lexer_failure, compiled.grammar[:160])
            return
        times = walk.times
        mean = probe_cost(times)
        if mean >= self.slow_mask_s:
            compiled.mask_cost.mark_slow()
            logger.warning("a grammar's token masks take %.2f ms each (%d probed, the slowest %.2f ms): marked slow, "
                           "its rows are filled apart from the batch's unless they fast-forward (CPU); the grammar "
                           "begins %r",
                           1e3 * mean, len(times), 1e3 * max(times), compiled.grammar[:160])

    def _compile(self, grammar: str) -> Union[CompiledGrammar, _Failure]:
        try:
            matcher = LLMatcher(self.tokenizer, grammar, log_level=self.log_level, limits=self.limits)
        except Exception as e:  # API misuse only (LLMatcher reports grammar faults via is_error)
            return _Failure(f"invalid grammar: {e}"[:MAX_ERROR_CHARS])
        if matcher.is_error():
            return _Failure(matcher.get_error()[:MAX_ERROR_CHARS])
        # The first mask too, here: a grammar over the limits already at its start is a 400,
        # not an error mid-request (and the lexer states it builds are shared by every copy).
        matcher.compute_bitmask()
        if matcher.is_error():
            return _Failure(_first_mask_error(matcher.get_error())[:MAX_ERROR_CHARS])
        warnings = tuple(matcher.get_grammar_warnings())
        if warnings:
            logger.info("grammar warnings: %s", "; ".join(warnings))
        return CompiledGrammar(grammar, matcher, warnings, _start_forced(matcher))


def _start_forced(template: LLMatcher) -> Optional[tuple[int, ...]]:
    """The tokens `template` forces at its start (None if that fails: each request then finds
    out, and ends with the error)."""
    try:
        matcher = template.deep_copy()
        forced = matcher.compute_ff_tokens()
    except Exception:
        return None
    return None if matcher.is_error() else tuple(forced)

