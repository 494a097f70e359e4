"""MaskPostProcessor on CPU logits: masking, commit-then-mask, row mapping, EOS at the end,
and per-row error isolation (rejected tokens, bad ids, a parser limit hit mid-generation, a lexer
out of fuel)."""

from __future__ import annotations

import asyncio

import llguidance
import numpy as np
import pytest
import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

from llgtrt_core.constraints import GrammarCompiler, GrammarConstraint
from llgtrt_core.constraints.loop_guard import EscapeMasks, _mask_row
from llgtrt_core.constraints.postprocessor import MaskPostProcessor, eos_only_mask
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from llgtrt_core.engine.interface import ConstrainedRow

BYTES = llguidance.LLTokenizer("byte")
VOCAB = BYTES.vocab_size
EOS = BYTES.eos_token


def constraint(grammar: str, compiler: GrammarCompiler | None = None) -> GrammarConstraint:
    compiler = compiler or GrammarCompiler(BYTES)
    return compiler.new_constraint(asyncio.run(compiler.compile(grammar)))


def regex(rx: str) -> GrammarConstraint:
    return constraint(llguidance.LLMatcher.grammar_from_regex(rx))


def allowed(row: torch.Tensor) -> set[int]:
    return {t for t in range(row.shape[0]) if not torch.isneginf(row[t])}


def llguidance_mask(matcher: llguidance.LLMatcher) -> torch.Tensor:
    mask = allocate_token_bitmask(1, VOCAB)
    fill_next_token_bitmask(matcher.deep_copy(), mask, 0)
    return mask[0]


@pytest.fixture(scope="module")
def processor() -> MaskPostProcessor:
    return MaskPostProcessor(BYTES, max_batch_size=4, num_threads=2)


def test_masks_disallowed_logits_and_leaves_the_rest_untouched(processor):
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    processor([ConstrainedRow(regex("[ab]c"), 0, None)], logits)
    assert allowed(logits[0]) == {ord("a"), ord("b")}
    assert torch.equal(logits[0, [ord("a"), ord("b")]], original[0, [ord("a"), ord("b")]])
    assert torch.equal(logits[1], original[1])  # not a constrained row


def test_commits_the_new_token_before_masking(processor):
    c = regex("[ab]c")
    processor([ConstrainedRow(c, 0, None)], torch.zeros(1, VOCAB))
    logits = torch.zeros(1, VOCAB)
    processor([ConstrainedRow(c, 0, ord("b"))], logits)
    assert allowed(logits[0]) == {ord("c")} and c.error is None


def test_batch_rows_map_to_their_logits_rows(processor):
    constraints = [regex("x+"), regex("[0-9]"), regex("(yes|no)")]
    targets = [3, 0, 2]
    logits = torch.randn(5, VOCAB)
    original = logits.clone()
    expected = [llguidance_mask(c.matcher) for c in constraints]
    rows = [ConstrainedRow(c, r, None) for c, r in zip(constraints, targets)]
    masks = processor.fill(rows)
    for j in range(3):
        assert torch.equal(masks[j], expected[j])
    processor.apply(rows, logits, masks)
    assert allowed(logits[3]) == {ord("x")}
    assert allowed(logits[0]) == {ord(d) for d in "0123456789"}
    assert allowed(logits[2]) == {ord("y"), ord("n")}
    assert torch.equal(logits[1], original[1]) and torch.equal(logits[4], original[4])


def test_complete_grammar_allows_eos_only_and_ends_cleanly(processor):
    c = regex("ok")
    logits = torch.zeros(1, VOCAB)
    processor([ConstrainedRow(c, 0, None)], logits)
    processor([ConstrainedRow(c, 0, ord("o"))], logits)
    logits = torch.zeros(1, VOCAB)
    processor([ConstrainedRow(c, 0, ord("k"))], logits)
    assert allowed(logits[0]) == {EOS} and c.error is None
    assert c.matcher.is_accepting()
    processor([ConstrainedRow(c, 0, EOS)], torch.zeros(1, VOCAB))  # an engine that commits EOS too
    assert c.error is None


@pytest.mark.parametrize("batch", [False, True])
def test_a_rejected_token_fails_that_row_only(processor, batch):
    bad, good = regex("[ab]+"), regex("[ab]+")
    rows = [ConstrainedRow(bad, 0, None)] + ([ConstrainedRow(good, 1, None)] if batch else [])
    processor(rows, torch.zeros(len(rows), VOCAB))
    logits = torch.randn(len(rows), VOCAB)
    rows = [ConstrainedRow(bad, 0, ord("z"))] + ([ConstrainedRow(good, 1, ord("a"))] if batch else [])
    processor(rows, logits)
    assert bad.error and "z" in bad.error
    assert allowed(logits[0]) == {EOS}
    if batch:
        assert good.error is None and allowed(logits[1]) == {ord("a"), ord("b"), EOS}
    later = torch.randn(1, VOCAB)
    processor([ConstrainedRow(bad, 0, ord("a"))], later)  # a failed row stays failed, EOS only
    assert allowed(later[0]) == {EOS}


@pytest.mark.parametrize("batch", [False, True])
def test_a_bad_token_id_fails_that_row_only(processor, batch):
    bad, good = regex("a+"), regex("a+")
    rows = [ConstrainedRow(bad, 0, 10**6)] + ([ConstrainedRow(good, 1, ord("a"))] if batch else [])
    logits = torch.zeros(len(rows), VOCAB)
    processor(rows, logits)
    assert bad.error and "out of range" in bad.error
    assert allowed(logits[0]) == {EOS}
    if batch:
        assert good.error is None and allowed(logits[1]) == {ord("a"), EOS}


def test_a_parser_limit_hit_mid_generation_ends_that_request_with_an_error(processor):
    tight = GrammarCompiler(BYTES, limits={"step_max_items": 50})
    ambiguous = llguidance.LLMatcher.grammar_from_lark('start: s\ns: s s | "a"')
    runaway, bystander = constraint(ambiguous, tight), regex("a+")
    token = None
    for _ in range(60):
        logits = torch.zeros(2, VOCAB)
        processor([ConstrainedRow(runaway, 0, token), ConstrainedRow(bystander, 1, token)], logits)
        if runaway.error:
            break
        token = ord("a")
    assert runaway.error and "Too many items" in runaway.error
    assert allowed(logits[0]) == {EOS}
    assert bystander.error is None and allowed(logits[1]) == {ord("a"), EOS}


# MaskBench's Github_easy---o21053 (a word-count `pattern` under a large `maxLength`): llguidance's lexer
# runs out of its per-token fuel a few characters into the string, whatever they are.
WORD_COUNT = json_schema_grammar({"type": "object", "required": ["q"], "additionalProperties": False, "properties": {
    "q": {"type": "string", "minLength": 1, "maxLength": 5000, "pattern": "^$|(^(?:\\S+\\s+){0,99}\\S+$)"}}})


def test_a_lexer_out_of_fuel_ends_its_request_naming_the_limit_and_its_grammar_is_compiled_afresh(processor):
    """Every copy of a compiled grammar shares its lexer, which fails for good: the next request
    handed a copy of it failed at its first token. It gets a fresh compile instead."""
    compiler = GrammarCompiler(BYTES)
    compiled = asyncio.run(compiler.compile(WORD_COUNT))
    first = compiler.new_constraint(compiled)
    for token in [None, *b'{"q":"ab cd ef']:
        processor([ConstrainedRow(first, 0, token)], torch.zeros(1, VOCAB))
        if first.error:
            break
    assert first.error and first.error.startswith("lexer error: too many expressions constructed")
    assert "llguidance.limits.step_lexer_fuel" in first.error and "non-verbose" not in first.error
    assert not compiler.new_constraint(compiled).matcher.consume_token(ord("{"))  # a copy of the failed one
    fresh = asyncio.run(compiler.compile(WORD_COUNT))
    assert fresh is not compiled and asyncio.run(compiler.compile(WORD_COUNT)) is fresh  # cached again
    second = compiler.new_constraint(fresh)
    for token in [None, *b'{"q":"']:
        processor([ConstrainedRow(second, 0, token)], torch.zeros(1, VOCAB))
    assert second.error is None
    relayed = compiler.new_constraint(fresh)  # the engine process's row, failed in the fill process
    relayed.fail(first.error)
    assert relayed.error == first.error


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(processor, dtype):
    logits = torch.randn(1, VOCAB).to(dtype)
    original = logits.clone()
    processor([ConstrainedRow(regex("q"), 0, None)], logits)
    masked = torch.ones(VOCAB, dtype=torch.bool)
    masked[ord("q")] = False
    lowest = torch.finfo(dtype).min
    assert bool(((logits[0, masked] == float("-inf")) | (logits[0, masked] == lowest)).all())
    assert logits[0, ord("q")] == original[0, ord("q")]


def test_logits_wider_than_the_tokenizer_mask_the_padding(processor):
    logits = torch.zeros(1, VOCAB + 40)
    processor([ConstrainedRow(regex("[a-z]+"), 0, None)], logits)
    assert torch.isneginf(logits[0, VOCAB:]).all()
    assert allowed(logits[0]) == {ord(c) for c in "abcdefghijklmnopqrstuvwxyz"}


def test_batches_larger_than_the_buffer_grow_it(processor):
    constraints = [regex("[0-9]") for _ in range(7)]
    logits = torch.randn(7, VOCAB)
    processor([ConstrainedRow(c, i, None) for i, c in enumerate(constraints)], logits)
    assert all(allowed(logits[i]) == {ord(d) for d in "0123456789"} for i in range(7))


def test_eos_only_mask_sets_exactly_the_eos_bits():
    mask = eos_only_mask([0, 31, 33, 63], 3)
    assert mask.dtype == torch.int32
    bits = {w * 32 + b for w in range(3) for b in range(32) if (int(mask[w]) >> b) & 1}
    assert bits == {0, 31, 33, 63}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_on_a_side_stream_match_the_cpu_path():
    processor = MaskPostProcessor(BYTES, max_batch_size=2)
    grammars = ["x+y", "[0-9]{2}", "(yes|no)"]
    on_cpu, on_gpu = [regex(g) for g in grammars], [regex(g) for g in grammars]
    stream = torch.cuda.Stream()
    for tokens in ([None, None, None], [ord("x"), ord("4"), ord("y")], [ord("x"), ord("2"), ord("e")]):
        logits = torch.randn(5, VOCAB + 40, dtype=torch.bfloat16)
        gpu_logits = logits.cuda()
        targets = [4, 1, 2]
        processor([ConstrainedRow(c, r, t) for c, r, t in zip(on_cpu, targets, tokens)], logits)
        stream.wait_stream(torch.cuda.current_stream())
        processor([ConstrainedRow(c, r, t) for c, r, t in zip(on_gpu, targets, tokens)], gpu_logits, stream)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(gpu_logits.cpu(), logits)
    assert [c.error is None for c in on_gpu] == [c.error is None for c in on_cpu] == [True, True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_upload_keeps_its_device_masks_until_the_work_queued_before_the_next_upload_read_them():
    """Uploads copy on a stream of their own, into two buffers in turn: the third upload reuses the
    first one's buffer and must wait for the readers of the first (queued behind a slow kernel)."""
    processor = MaskPostProcessor(BYTES, max_batch_size=4)
    rows = [ConstrainedRow(regex("x"), j, None) for j in range(4)]
    words = allocate_token_bitmask(1, VOCAB).shape[1]
    device = torch.device("cuda")
    hosts = [torch.full((4, words), value, dtype=torch.int32).pin_memory() for value in (1, 2, 3)]
    reads = []
    for index, host in enumerate(hosts):
        device_masks, device_rows = processor.upload(rows, host, device)
        if index == 0:
            torch.cuda._sleep(200_000_000)  # ~0.1 s on the compute stream before the first read
        reads.append((device_masks.clone(), device_rows.clone()))
    torch.cuda.synchronize()
    for host, (device_masks, device_rows) in zip(hosts, reads):
        assert torch.equal(device_masks.cpu(), host)
        assert device_rows.tolist() == [0, 1, 2, 3]


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs CUDA")])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_the_cuda_narrowing_to_endings_matches_the_host_narrowing(seed):
    """On a GPU `upload` narrows the masks of rows near their length limit with a CUDA kernel
    (`narrow_to_endings`); the fill's numpy `narrow` is the reference. Random masks over a
    vocabulary with words, newlines and every escape class, inside and outside strings."""
    from llgtrt_core.kernels import narrow_to_endings

    rng = np.random.default_rng(seed)
    texts = ["ab", " word", "x", "1", '"', '",', '"]', '"}', "]", "}", ",", "]}", "\n", "a\nb", "{", "["] * 300
    words = (len(texts) + 31) // 32
    escapes = EscapeMasks(texts, [3], words)
    # Each row allows each token with a chance of its own: from a few tokens to nearly all.
    allowed = rng.random((64, len(texts))) < rng.choice([0.001, 0.003, 0.01, 0.1, 0.9], size=(64, 1))
    host = torch.from_numpy(np.stack([_mask_row(np.flatnonzero(row).tolist(), words) for row in allowed]))
    positions = sorted(rng.choice(64, 48, replace=False).tolist())
    expected = host.clone()
    escapes.narrow_to_endings(expected, positions)
    on_device = host.cuda()
    tables, string_classes = escapes.ending_tables()
    narrow_to_endings(on_device, torch.tensor(positions, device="cuda"), torch.from_numpy(tables).cuda(),
                      string_classes)
    assert torch.equal(on_device.cpu(), expected)
    assert (expected != host).any(1).sum() >= 5  # rows were narrowed


@pytest.mark.parametrize("device", DEVICES)
def test_an_upload_narrows_the_masks_of_rows_near_their_length_limit_only(device):
    """A row near its length limit gets the grammar's mask narrowed to the nearest ending at the
    upload (the host buffer on CPU, a kernel on CUDA); a row far from it keeps the grammar's own."""
    from llgtrt_core.constraints.request_grammar import json_schema_grammar
    from llgtrt_core.engine.interface import LoopGuardSettings

    compiler = GrammarCompiler(BYTES)
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a"], "additionalProperties": False}
    compiled = asyncio.run(compiler.compile(json_schema_grammar(schema)))
    near = compiler.new_constraint(compiled, loop_guard=LoopGuardSettings(max_tokens=12, closing_margin=1))
    far = compiler.new_constraint(compiled, loop_guard=LoopGuardSettings(max_tokens=1000))
    processor = MaskPostProcessor(BYTES, max_batch_size=2, num_threads=1)
    tokens = [None, *b'{"a":[1,2,3']  # 11 of max_tokens 12: one left, two brackets open
    for token in tokens:
        rows = [ConstrainedRow(near, 1, token), ConstrainedRow(far, 0, token)]
        host = processor.fill(rows)
        grammars_own = host.clone()
        masks, indices = processor.upload(rows, host, torch.device(device))
        masks = masks.cpu()
    assert near.closing and not far.closing
    assert indices.tolist() == [1, 0]
    allowed_near = {t for t in range(VOCAB) if (int(masks[0, t // 32]) >> (t % 32)) & 1}
    assert allowed_near == {ord("]")}  # the array's closing bracket, not a digit, "," or a space
    assert torch.equal(masks[1], grammars_own[1])
    assert not torch.equal(masks[0], grammars_own[0])
