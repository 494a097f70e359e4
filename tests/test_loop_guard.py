"""The loop guard on real llguidance matchers with the default model's tokenizer: a looping
answer is steered out and completes valid, an answer that does not loop gets the grammar's own
masks, and a loop of any period is found."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import jsonschema
import pytest
import torch

from llgtrt_core.constraints import GrammarCompiler, build_ll_tokenizer
from llgtrt_core.constraints.loop_guard import (IN_STRING, OUTSIDE, EscapeMasks, LoopGuard, LoopGuardSettings,
                                              loop_steering, steer_loops)
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from llgtrt_core.engine.interface import ConstrainedRow

MAX_STEPS = 400


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


@pytest.fixture(scope="module")
def parts(hf_tokenizer: Any) -> tuple[GrammarCompiler, MaskPostProcessor]:
    ll_tokenizer = build_ll_tokenizer(hf_tokenizer)
    return GrammarCompiler(ll_tokenizer), MaskPostProcessor(ll_tokenizer, max_batch_size=2, num_threads=1)


def allowed(mask_row) -> list[int]:
    return [word * 32 + bit for word, value in enumerate(mask_row.tolist()) for bit in range(32) if (value >> bit) & 1]


@dataclasses.dataclass
class Guarded:  # what the loop guard reads and writes of a constraint
    loop_guard: LoopGuard
    error: Optional[str] = None
    closing: bool = False


def step_masks(processor: MaskPostProcessor, rows: list[ConstrainedRow]) -> torch.Tensor:
    """A step's masks as the CPU engine samples with them: filled, then uploaded (which narrows the
    masks of rows near their length limit)."""
    return processor.upload(rows, processor.fill(rows), torch.device("cpu"))[0]


def stubborn_model(parts, hf_tokenizer, schema: dict, prefix: str, unit: str, guard: Optional[LoopGuardSettings],
                   fast_forward: bool = False) -> tuple[str, str]:
    """Decode with a 'model' that always wants to write `prefix` then `unit` forever: it takes its
    wanted token when the mask allows it, else the first allowed token (and then wants `unit`
    again). Returns (text, "stop" | "length"); "length" past MAX_STEPS tokens or the guard's
    `max_tokens`."""
    compiler, processor = parts
    constraint = compiler.new_constraint(asyncio.run(compiler.compile(json_schema_grammar(schema))), loop_guard=guard)
    eos = set(compiler.tokenizer.eos_tokens)
    wanted = hf_tokenizer.encode(prefix + unit * MAX_STEPS, add_special_tokens=False)
    out: list[int] = []
    token = None
    while len(out) < min(MAX_STEPS, guard and guard.max_tokens or MAX_STEPS):
        if fast_forward:  # the PyTorch engine's path: commits go through commit_with_forced
            out += processor.commit_with_forced(constraint, token, 0)
            token = None
        mask = allowed(step_masks(processor, [ConstrainedRow(constraint, 0, token)])[0])
        assert constraint.error is None
        want = wanted[len(out)] if len(out) < len(wanted) else None
        token = want if want in mask else mask[0]
        if token in eos:
            return hf_tokenizer.decode(out), "stop"
        out.append(token)
        if token != want:
            wanted = out + hf_tokenizer.encode(unit * MAX_STEPS, add_special_tokens=False)
    return hf_tokenizer.decode(out), "length"


LOOPS = [
    ({"type": "object", "properties": {"shapes": {"type": "array", "items": {"type": "string"}}},
      "required": ["shapes"], "additionalProperties": False}, '{"shapes":["circle"', ',"circle"'),
    ({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
      "required": ["name", "n"], "additionalProperties": False}, '{"name":"loh', "-loh"),
    ({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"], "additionalProperties": False},
     '{"x":1.', "1"),
    ({"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
     '{"items":[{"a":"x","b":1}', ',{"a":"x","b":1}'),
    ({"type": "object", "properties": {"v": {"type": "string", "pattern": "^[0-9.]+$"}}, "required": ["v"],
      "additionalProperties": False}, '{"v":"1', ".1"),  # a string that allows no words
]


@pytest.mark.parametrize("fast_forward", [False, True])
@pytest.mark.parametrize("schema,prefix,unit", LOOPS)
def test_a_looping_answer_is_steered_out_and_completes_valid(parts, hf_tokenizer, schema, prefix, unit, fast_forward):
    text, finish = stubborn_model(parts, hf_tokenizer, schema, prefix, unit, None, fast_forward)
    assert finish == "length"  # without the guard it loops to the end
    text, finish = stubborn_model(parts, hf_tokenizer, schema, prefix, unit, LoopGuardSettings(), fast_forward)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_an_answer_that_does_not_loop_keeps_the_grammars_masks(parts, hf_tokenizer):
    compiler, processor = parts
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                               "n": {"type": "integer"}}}
    # Repetitive but short of a loop: ten items, each different, digits that repeat a little.
    document = json.dumps({"tags": [f"tag {i} of the list" for i in range(10)], "n": 1000000},
                          separators=(",", ":"))
    tokens = hf_tokenizer.encode(document, add_special_tokens=False)
    # The length limit just out of reach: two brackets stay open until the end.
    settings = LoopGuardSettings(closing_margin=5, max_tokens=len(tokens) + 5 + 1)
    compiled = asyncio.run(compiler.compile(json_schema_grammar(schema)))
    guarded, plain = compiler.new_constraint(compiled, loop_guard=settings), compiler.new_constraint(compiled)
    token = None
    for next_token in [*tokens, None]:
        masks = step_masks(processor, [ConstrainedRow(guarded, 0, token), ConstrainedRow(plain, 1, token)])
        assert masks[0].equal(masks[1])
        token = next_token
    assert not guarded.loop_guard.escaping and not guarded.loop_guard.closing


def test_a_loop_of_any_period_is_found_after_min_repeats_periods():
    guard = LoopGuard(LoopGuardSettings(min_span=32, min_repeats=3))
    period = list(range(997))  # far longer than any fixed set of candidate periods would try
    tokens = [5000, 5001, *period * 3]
    for token in tokens[:-1]:
        guard.observe(token)
    assert not guard.escaping  # three periods less one token
    guard.observe(tokens[-1])
    assert guard.escaping


# Loops no period check sees: items that differ each time, a recursion that opens the object
# again with a new name, a string that never closes. Only the length limit ends them.
RECURSIVE = {"type": "object", "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}},
             "required": ["name"], "additionalProperties": False}
NON_PERIODIC = [
    ({"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}}},
      "required": ["ids"], "additionalProperties": False},
     '{"ids":[' + ",".join(str(i) for i in range(100, 2000))),
    ({"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
      "required": ["text", "n"], "additionalProperties": False},
     '{"text":"' + " ".join(f"step {i}" for i in range(2000))),
    (RECURSIVE, "".join(f'{{"name":"node {i}","child":' for i in range(500))),
]


@pytest.mark.parametrize("fast_forward", [False, True])
@pytest.mark.parametrize("schema,text", NON_PERIODIC)
def test_an_answer_that_would_run_to_max_tokens_closes_before_it(parts, hf_tokenizer, schema, text, fast_forward):
    no_periods = LoopGuardSettings(min_span=10**6)  # the length limit alone
    _, finish = stubborn_model(parts, hf_tokenizer, schema, text, "", dataclasses.replace(no_periods), fast_forward)
    assert finish == "length"  # no max_tokens given: nothing steers
    out, finish = stubborn_model(parts, hf_tokenizer, schema, text, "",
                                 dataclasses.replace(no_periods, max_tokens=150), fast_forward)
    assert finish == "stop", out
    assert len(hf_tokenizer.encode(out, add_special_tokens=False)) <= 150
    jsonschema.validate(json.loads(out), schema)


def test_the_length_limit_margin_is_at_most_a_tenth_of_max_tokens_plus_the_open_brackets():
    escapes = EscapeMasks(["x", "{", "}"], [2], 1)
    guard = LoopGuard(LoopGuardSettings(closing_margin=24, max_tokens=40))  # margin 4, not 24
    guard.observe(1)  # one bracket open
    while len(guard.tokens) < 34:
        guard.observe(0)
        assert not guard.near_limit(escapes)
    guard.observe(0)  # 5 tokens left: 4 + 1 open bracket
    assert guard.near_limit(escapes) and guard.closing


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tokens", ["each opens the most brackets", "mixed, several at a time"])
def test_the_length_limit_check_skipped_while_there_is_room_answers_as_a_full_check(seed, tokens):
    """`near_limit` skips its count while the room left could not be used up yet: step by step it
    answers as a twin that checks in full on every call. Tokens that each open the most brackets
    a token can make the skip's bound exact (a step too many would be seen); mixed ones, several
    at a time (forced tokens) and not asked every step, cover the rest."""
    import random
    rng = random.Random(seed)
    escapes = EscapeMasks(["x", "{", "}", "[[", "]]", "{[", "x}", '"', '}"{'], [0], 1)
    settings = LoopGuardSettings(closing_margin=rng.randrange(1, 30), max_tokens=rng.randrange(10, 400))
    tight = tokens.startswith("each")
    skipping, full = LoopGuard(settings), LoopGuard(settings)
    answers = []
    while len(full.tokens) < settings.max_tokens:
        step = [3] if tight else [rng.choice([0, 0, 0, *range(1, 9)]) for _ in range(rng.choice([1, 1, 1, 3]))]
        skipping.observe_all(step)
        full.observe_all(step)
        if tight or rng.random() < 0.8:
            full._check_at = 0  # the twin counts every time
            answers.append(skipping.near_limit(escapes))
            assert answers[-1] == full.near_limit(escapes), len(full.tokens)
    assert answers[-1] and not answers[0]


def test_free_text_before_the_answer_is_never_steered(parts, hf_tokenizer):
    """A reasoning section's thinking is free text (words and raw newlines, unlike a JSON string):
    near the length limit and looping, its masks stay the grammar's own."""
    from llgtrt_core.constraints.reasoning_grammar import reasoning_grammar

    compiler, processor = parts
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    grammar = reasoning_grammar("<think>", "</think>", 400, json_schema_grammar(schema), {})
    compiled = asyncio.run(compiler.compile(grammar))
    guarded = compiler.new_constraint(compiled, loop_guard=LoopGuardSettings(max_tokens=60))
    plain = compiler.new_constraint(compiled)
    thinking = "<think>" + 'He said "no", then\n' * 40
    token = None
    for next_token in hf_tokenizer.encode(thinking, add_special_tokens=False)[:59]:
        masks = step_masks(processor, [ConstrainedRow(guarded, 0, token), ConstrainedRow(plain, 1, token)])
        assert masks[0].equal(masks[1])
        token = next_token
    # Near the limit and looping: the limit is checked while a loop's escape is pending too.
    assert guarded.loop_guard.closing and guarded.loop_guard.escaping and guarded.closing



def test_rows_steered_together_each_get_their_own_escape_class():
    # token ids:     0      1     2    3      4     5     6      7
    texts = ["word", '"', "1", "}", ",", "\n", "x", '"}']
    escapes = EscapeMasks(texts, [], 1)

    def mask(*tokens: int) -> int:
        return sum(1 << t for t in tokens)

    masks = torch.tensor([[mask(0, 1, 7)],  # inside a string: its closing quotes, ending the container first
                          [mask(2, 4, 6)],  # a loop in a number: `}` not allowed, `,` is
                          [mask(2, 6)],  # a loop over items: nothing closes the container here
                          [mask(0, 5, 1)],  # free text: never steered
                          [mask(2, 3)]], dtype=torch.int32)  # a loop in a number: `}`
    narrowed = escapes.narrow(masks, [0, 1, 2, 3, 4], [False, False, True, False, False])
    assert narrowed == [True, True, False, False, True]
    assert masks[:, 0].tolist() == [mask(7), mask(4), mask(2, 6), mask(0, 5, 1), mask(3)]


def test_a_row_that_fails_while_its_mask_is_computed_is_not_steered():
    """The fill decides the steering (`loop_steering`) while the masks are computed; a row whose
    grammar fails meanwhile gets the EOS-only mask, which `steer_loops` leaves alone."""
    texts = ["word", '"', "1", "}", ","]
    escapes = EscapeMasks(texts, [], 1)

    constraints = [Guarded(LoopGuard()) for _ in range(2)]
    for constraint in constraints:
        constraint.loop_guard.observe_all([2] * 40)  # a number looping: "1111..."
    rows = [ConstrainedRow(constraint, j, 2) for j, constraint in enumerate(constraints)]
    steering = loop_steering(rows, escapes)
    assert [j for j, _, _ in steering] == [0, 1]
    constraints[0].error = "grammar failed while its mask was computed"
    masks = torch.tensor([[0b11100], [0b11100]], dtype=torch.int32)  # "1", "}", ","
    steer_loops(rows, masks, steering, escapes)
    assert masks[:, 0].tolist() == [0b11100, 0b01000]  # the failed row untouched; the other: `}`


def test_a_row_near_its_length_limit_is_marked_closing_and_left_to_the_upload():
    """The fill steers looping rows' host masks; a row near its length limit is marked `closing`
    on its constraint (for good) and its mask is narrowed where the masks are uploaded."""
    escapes = EscapeMasks(["word", '"', "1", "}", ","], [], 1)
    near, looping = Guarded(LoopGuard(LoopGuardSettings(max_tokens=10))), Guarded(LoopGuard())
    near.loop_guard.observe_all([2] * 8)  # one token from its limit of ten
    looping.loop_guard.observe_all([2] * 40)
    steering = loop_steering([ConstrainedRow(near, 0, 2), ConstrainedRow(looping, 1, 2)], escapes)
    assert [j for j, _, _ in steering] == [1]
    assert near.closing and not looping.closing


def test_a_row_whose_only_word_lies_outside_the_sampled_mask_words_is_still_inside_a_string():
    """`narrow` asks first whether a row allows a word token in the 16 mask words richest in them;
    a string whose pattern allows only a rarer word is found by reading the rest."""
    words = 40
    texts = ["x"] * (32 * words)
    for word in range(words):  # word tokens in every mask word; word 39 holds the fewest
        for bit in range(1 if word == 39 else 8):
            texts[32 * word + bit] = "ab"
    texts[20:23] = ['"', "}", '"}']
    rare_word, quote, brace, quote_brace = 32 * 39, 20, 21, 22
    escapes = EscapeMasks(texts, [], words)
    assert 39 not in escapes._word_sample.tolist()

    def mask(*tokens: int) -> list[int]:
        row = [0] * words
        for t in tokens:
            row[t // 32] |= 1 << (t % 32)
        return [v - (1 << 32) if v >= 1 << 31 else v for v in row]

    masks = torch.tensor([mask(rare_word, quote, brace, quote_brace),  # inside a string: its closing quotes
                          mask(32 * 5, quote, quote_brace),  # a common word: settled by the sample
                          mask(quote, brace)], dtype=torch.int32)  # outside strings: `}` closes the value
    narrowed = escapes.narrow(masks, [0, 1, 2], [False, False, False])
    assert narrowed == [True, True, True]
    assert masks.tolist() == [mask(quote_brace), mask(quote_brace), mask(brace)]


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.parametrize("fast_forward", [False, True])
def test_brackets_written_inside_a_string_leave_the_object_open(parts, hf_tokenizer, fast_forward):
    """A small model often writes `}` inside the string it is in (`{"city":"Seattle} ...`). The
    length limit still counts the object open, so the answer closes with its required key before
    max_tokens (counted as closed, this answer ran out at 80 tokens, one token short)."""
    text = '{"city":"Seattle}]} ' + " ".join(f"word{i}" for i in range(2000))
    out, finish = stubborn_model(parts, hf_tokenizer, CITY, text, "",
                                 LoopGuardSettings(min_span=10**6, max_tokens=80), fast_forward)
    assert finish == "stop", out
    jsonschema.validate(json.loads(out), CITY)


def test_the_length_limit_counts_brackets_outside_strings_only():
    texts = ["x", "{", "}", '"', 'a}', '\\"', '"}']
    escapes = EscapeMasks(texts, [0], 1)
    # `{"a}` opens the object and a string; `}` in the string and an escaped quote change nothing;
    # `"}` closes the string, then the object.
    assert escapes.count_open([1, 3, 4, 5, 2], 0, OUTSIDE) == (1, IN_STRING)
    assert escapes.count_open([6], 1, IN_STRING) == (0, OUTSIDE)
    guard = LoopGuard(LoopGuardSettings(closing_margin=24, max_tokens=40))  # margin 4
    guard.observe_all([1, 3, 4, 4])  # {"a}a}: the object open, in a string
    while len(guard.tokens) < 34:
        guard.observe(0)
        assert not guard.near_limit(escapes)
    guard.observe(0)  # 5 tokens left: 4 + the open object
    assert guard.near_limit(escapes)
