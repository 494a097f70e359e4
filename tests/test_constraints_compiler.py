"""GrammarCompiler: validation with llguidance's own messages, the LRU cache, one compile per
text, the event loop kept free, configurable limits, the probe of each new grammar's mask cost;
and the llguidance tokenizer builder."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import time

import llguidance
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llgtrt_core.constraints import (GrammarCompiler, GrammarConstraint, GrammarRequestError, GrammarText,
                                    build_ll_tokenizer)
from llgtrt_core.config import LlguidanceConfig
from llgtrt_core.constraints.mask_probe import (PROBE_START_TOKENS, PROBE_TOKENS, draw_allowed, mask_probe_seconds,
                                                probe_cost)
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from tests.test_constraints_postprocessor import WORD_COUNT

BYTES = llguidance.LLTokenizer("byte")
DIGITS = llguidance.LLMatcher.grammar_from_regex("[0-9]+")
UNDEFINED_RULE = llguidance.LLMatcher.grammar_from_lark("start: undefined_rule")


def run(coroutine):
    return asyncio.run(coroutine)


def test_compile_returns_a_template_and_caches_it_by_text():
    compiler = GrammarCompiler(BYTES)
    first = run(compiler.compile(DIGITS))
    assert first.grammar == DIGITS and not first.matcher.is_error()
    assert run(compiler.compile(DIGITS)) is first


def test_a_cache_hit_answers_without_suspending():
    """At load every suspension queues the request behind all the others' work on the event loop."""
    compiler = GrammarCompiler(BYTES)
    first = run(compiler.compile(DIGITS))
    waiter = compiler.compile(DIGITS)
    with pytest.raises(StopIteration) as done:
        waiter.send(None)  # runs to its end at once: no await suspended it
    assert done.value.value is first
    with pytest.raises(GrammarRequestError):  # a cached failure too
        run(compiler.compile(UNDEFINED_RULE))
    waiter = compiler.compile(UNDEFINED_RULE)
    with pytest.raises(GrammarRequestError):
        waiter.send(None)


def test_a_compiler_whose_engine_compiles_hands_on_the_text_alone():
    """The embedded engine's process compiles and refuses grammars itself: the API worker's
    constraint is the text and the field, whatever the text (even one that will not compile)."""
    compiler = GrammarCompiler(BYTES)
    compiler.compiled_by_engine = True
    for grammar in (DIGITS, UNDEFINED_RULE):
        constraint = run(compiler.constraint(grammar, "response_format.json_schema"))
        assert type(constraint) is GrammarText and constraint.grammar == grammar
        assert constraint.param == "response_format.json_schema" and constraint.error is None
    assert not compiler._cache and not compiler._pending


def test_cache_is_lru_bounded():
    compiler = GrammarCompiler(BYTES, cache_size=2)
    grammars = [llguidance.LLMatcher.grammar_from_regex(rx) for rx in ("a", "b", "c")]

    async def scenario():
        a = await compiler.compile(grammars[0])
        await compiler.compile(grammars[1])
        assert await compiler.compile(grammars[0]) is a  # a is now the most recent
        await compiler.compile(grammars[2])  # evicts b, not a
        assert await compiler.compile(grammars[0]) is a
        return a

    run(scenario())
    assert list(compiler._cache) == [grammars[2], grammars[0]]


@pytest.mark.parametrize(
    "grammar",
    [
        llguidance.LLMatcher.grammar_from_regex("a(b"),
        llguidance.LLMatcher.grammar_from_lark("start: undefined_rule"),
        json_schema_grammar({"type": "string", "format": "no-such-format"}),
        json_schema_grammar({"type": "string", "pattern": "(?=lookahead)"}),
        '{"grammars": 5}',
    ],
)
def test_invalid_grammar_raises_llguidances_own_message(grammar):
    compiler = GrammarCompiler(BYTES)
    with pytest.raises(GrammarRequestError) as error:
        run(compiler.compile(grammar, param="guided_grammar"))
    assert error.value.param == "guided_grammar"
    expected = llguidance.LLMatcher.validate_grammar(grammar, BYTES, limits=compiler.limits)
    assert expected and error.value.message == expected
    with pytest.raises(GrammarRequestError):  # the failure is cached as well
        run(compiler.compile(grammar))
    assert grammar in compiler._cache


def test_grammar_size_limit_is_configurable():
    rules = "\n".join(f'a{i}: "x" "{i}" b' for i in range(300))
    big = llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(f"a{i}" for i in range(300)) + "\n" + rules + '\nb: "q" "r"')
    assert run(GrammarCompiler(BYTES).compile(big))
    with pytest.raises(GrammarRequestError, match="grammar size .* too big"):
        run(GrammarCompiler(BYTES, limits={"max_grammar_size": 100}).compile(big))


def test_concurrent_requests_share_one_compile():
    compiler = GrammarCompiler(BYTES)
    grammar = llguidance.grammar_from("choice", json.dumps([f"w{i}" for i in range(500)]))

    async def scenario():
        return await asyncio.gather(*(compiler.compile(grammar) for _ in range(8)))

    results = run(scenario())
    assert all(result is results[0] for result in results)


def test_compiling_never_blocks_the_event_loop():
    compiler = GrammarCompiler(BYTES)
    slow = llguidance.grammar_from("choice", json.dumps([f"word{i}x{i * 7}" for i in range(8000)]))

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        start = time.perf_counter()
        await compiler.compile(slow)
        elapsed = time.perf_counter() - start
        task.cancel()
        return ticks, elapsed

    ticks, elapsed = run(scenario())
    assert elapsed > 0.02, "the grammar must be slow enough to tell"
    assert ticks >= 5, f"the loop ran only {ticks} times during a {elapsed:.3f} s compile"


def test_each_request_gets_its_own_matcher_state():
    compiler = GrammarCompiler(BYTES)
    compiled = run(compiler.compile(DIGITS))
    first, second = compiler.new_constraint(compiled), compiler.new_constraint(compiled)
    assert isinstance(first, GrammarConstraint) and first.error is None
    assert first.matcher.consume_tokens(list(b"12"))
    assert not second.matcher.consume_token(ord("x"))  # fails alone
    assert not first.matcher.is_error() and not compiled.matcher.is_error()
    assert compiled.matcher.validate_tokens(list(b"9")) == 1  # the template was never advanced
    first.fail("boom")
    first.fail("second message is ignored")
    assert first.error == "boom" and second.error is None


def test_a_mask_probe_walks_a_copy_on_allowed_tokens_until_the_grammar_ends():
    compiled = run(GrammarCompiler(BYTES).compile(DIGITS))
    times = mask_probe_seconds(compiled.matcher, 16, random.Random(0), [BYTES.eos_token]).times
    assert len(times) == 16 and all(t > 0 for t in times)  # digits go on: EOS avoided while a digit is allowed
    assert compiled.matcher.validate_tokens(list(b"9")) == 1  # the template was never advanced
    short = run(GrammarCompiler(BYTES).compile(llguidance.LLMatcher.grammar_from_regex("ab")))
    assert 2 <= len(mask_probe_seconds(short.matcher, 16, random.Random(0), [BYTES.eos_token]).times) < 16


def test_a_probe_draws_each_allowed_token_alike_and_an_avoided_one_only_when_alone():
    rng = random.Random(0)
    mask = np.zeros(4, dtype=np.uint8)
    mask[0], mask[3] = 0b10010001, 0b10000000  # tokens 0, 4, 7 and 31
    drawn = collections.Counter(draw_allowed(mask, rng, [7]) for _ in range(3000))
    assert set(drawn) == {0, 4, 31} and min(drawn.values()) > 900
    assert draw_allowed(np.array([0, 0b100, 0, 0], dtype=np.uint8), rng, [10]) == 10
    assert draw_allowed(np.zeros(4, dtype=np.uint8), rng) is None


def test_a_probe_judges_a_grammar_by_its_first_masks_or_its_whole_walk_whichever_is_slower():
    start, rest = PROBE_START_TOKENS, PROBE_TOKENS - PROBE_START_TOKENS
    slow_at_start = [1.0] * start + [0.0] * rest
    slow_further_on = [0.0] * start + [1.0] * rest
    assert probe_cost(slow_at_start) == 1.0  # the whole walk's mean alone would be 0.25
    assert probe_cost(slow_further_on) == rest / PROBE_TOKENS
    assert probe_cost([0.5] * 3) == 0.5  # a walk ended early by its grammar


def probe_warnings(compiler: GrammarCompiler, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings of `compiler`'s probes once they are done (compiling DIGITS the one way the
    compiler's `compiled_by_engine` leaves)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llgtrt_core.constraints.grammar"):
        run(compiler.compile(DIGITS))
        compiler._pool.shutdown(wait=True)  # the compile, which queues the probe
        compiler._probes.shutdown(wait=True)
    return [r.getMessage() for r in caplog.records if "token masks take" in r.getMessage()]


def test_a_new_grammar_whose_masks_are_slow_is_marked_and_warned_of(caplog):
    """A grammar slower than slow_mask_s would hold up every step of a batch it is in: its probe
    marks it slow (the engine fills its rows apart) and says so, once, in the log."""
    slow = GrammarCompiler(BYTES, slow_mask_s=0.0)
    warned = probe_warnings(slow, caplog)
    assert len(warned) == 1 and f"{PROBE_TOKENS} probed" in warned[0] and "[0-9]+" in warned[0]
    assert run(slow.compile(DIGITS)).mask_cost.slow and slow.new_constraint(run(slow.compile(DIGITS))).mask_cost.slow
    fast = GrammarCompiler(BYTES, slow_mask_s=60.0)
    assert probe_warnings(fast, caplog) == []  # no mask takes a minute
    assert not run(fast.compile(DIGITS)).mask_cost.slow
    assert probe_warnings(GrammarCompiler(BYTES, slow_mask_s=None), caplog) == []
    worker = GrammarCompiler(BYTES, slow_mask_s=0.0)
    worker.compiled_by_engine = True  # an API worker: the engine process compiles and probes
    assert probe_warnings(worker, caplog) == []
    # The server's compilers (from its config) probe; one built outside it (a benchmark's) does not.
    assert GrammarCompiler.from_config(BYTES, LlguidanceConfig()).slow_mask_s == 0.0005  # llguidance.slow_mask_ms
    assert GrammarCompiler.from_config(BYTES, LlguidanceConfig(slow_mask_ms=None)).slow_mask_s is None
    assert GrammarCompiler(BYTES).slow_mask_s is None


def test_a_probe_that_breaks_the_shared_lexer_has_the_grammar_compiled_afresh(caplog):
    """The probe walks a copy of the template, whose lexer every request's copy shares: a walk
    that runs it out of fuel would fail each later request at its first token."""
    compiler = GrammarCompiler(BYTES, slow_mask_s=0.0)
    with caplog.at_level(logging.WARNING, logger="llgtrt_core.constraints.grammar"):
        probed = run(compiler.compile(WORD_COUNT))
        compiler._probes.shutdown(wait=True)
    assert [r.getMessage() for r in caplog.records if "lexer failed on the probe" in r.getMessage()]
    assert not probed.mask_cost.slow  # a failed walk judges no cost
    fresh = run(compiler.compile(WORD_COUNT))
    assert fresh is not probed and compiler.new_constraint(fresh).matcher.consume_token(ord("{"))


def test_request_grammar_and_its_constraint():
    compiler = GrammarCompiler(BYTES)

    class Request:
        response_format = None
        structured_outputs = None
        guided_json = guided_choice = guided_grammar = guided_whitespace_pattern = None
        guided_regex = "[ab]+"

    found = compiler.request_grammar(Request())
    constraint = run(compiler.constraint(found.grammar, found.param))
    assert found.param == "guided_regex" and constraint.matcher.consume_tokens(list(b"abba"))
    Request.guided_regex = None
    assert compiler.request_grammar(Request()) is None
    Request.guided_regex = "(unclosed"
    found = compiler.request_grammar(Request())
    with pytest.raises(GrammarRequestError) as error:
        run(compiler.constraint(found.grammar, found.param))
    assert error.value.param == "guided_regex" and "unclosed" in error.value.message


def test_a_grammar_past_max_grammar_chars_is_refused_before_it_compiles():
    compiled: list[str] = []
    compiler = GrammarCompiler(BYTES, max_grammar_chars=200, on_miss=compiled.append)
    short, long = json_schema_grammar({"type": "string"}), json_schema_grammar({"enum": ["x" * 200]})
    assert run(compiler.constraint(short, "response_format.json_schema")).matcher.consume_tokens(list(b'"a"'))
    with pytest.raises(GrammarRequestError) as error:
        run(compiler.constraint(long, "response_format.json_schema"))
    assert error.value.param == "response_format.json_schema"
    assert f"{len(long)} characters" in error.value.message and "llguidance.max_grammar_chars" in error.value.message
    assert compiled == [short]  # the long one never reached llguidance
    assert run(GrammarCompiler(BYTES).constraint(long, "response_format.json_schema")).error is None  # 0: no limit


def tiny_hf_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with no merges: 256 byte tokens plus <eos> (id 256)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def test_build_ll_tokenizer_pads_to_the_models_vocab_and_takes_eos_overrides():
    hf = tiny_hf_tokenizer()
    padded = build_ll_tokenizer(hf, vocab_size=320)
    assert padded.vocab_size == 320 and padded.eos_token == hf.eos_token_id == 256
    assert padded.tokenize_str("ab") == hf.encode("ab")
    overridden = build_ll_tokenizer(hf, eos_token_ids=[7, 256])
    assert overridden.vocab_size == 257 and overridden.eos_tokens == [7, 256]
