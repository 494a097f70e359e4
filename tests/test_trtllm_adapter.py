"""The TensorRT-LLM adapter against a FAKE `tensorrt_llm` (tests/fake_tensorrt_llm): the real
wheel cannot be installed here. Our own parts are real: the adapter, its processors, the
llguidance MaskPostProcessor and the mask kernel's CPU path. Only tensorrt_llm is faked.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
from pathlib import Path
from typing import Optional, Sequence

import pytest
import torch
from llguidance import LLMatcher, LLTokenizer

from llgtrt_core.constraints.grammar import GrammarCompiler, GrammarConstraint, build_ll_tokenizer
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.engine.interface import ConstrainedRow, EngineError, GenerationRequest, SamplingParams
from llgtrt_core.engine.trtllm_engine import (
    TrtLlmEngine,
    TrtLlmEngineConfig,
    config_for_stored_model,
    finish_reason_of,
    trt_sampling_kwargs,
    unsupported_sampling,
)
from llgtrt_core.engine.trtllm_processors import (
    BatchedConstraintProcessor,
    ConstrainedRequests,
    GrammarSettings,
    ProcessorSession,
    RequestConstraintProcessor,
    WorkerGrammar,
    copy_mask_to_other_beams,
)

FAKE_ROOT = Path(__file__).parent / "fake_tensorrt_llm"
BYTE_TOKENIZER = LLTokenizer("byte")  # 262 tokens: bytes 0-255, specials; EOS 261
VOCAB = BYTE_TOKENIZER.vocab_size
EOS = 261
ABC = [97, 98, 99]


def _drop_tensorrt_llm_modules() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def fake_trt(monkeypatch):
    """The FAKE tensorrt_llm, in sys.modules for this test only."""
    _drop_tensorrt_llm_modules()
    monkeypatch.syspath_prepend(str(FAKE_ROOT))
    monkeypatch.delenv("TLLM_WORKER_USE_SINGLE_PROCESS", raising=False)
    import tensorrt_llm

    assert tensorrt_llm.IS_FAKE
    yield tensorrt_llm
    _drop_tensorrt_llm_modules()


@pytest.fixture
def model_dir(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return tmp_path


class RecordingPostProcessor:
    """Delegates to the real MaskPostProcessor and remembers what each call got."""

    def __init__(self) -> None:
        self.real = MaskPostProcessor(BYTE_TOKENIZER, max_batch_size=8, num_threads=2)
        self.calls: list[tuple[list[tuple[int, Optional[int]]], tuple[int, ...], object]] = []

    def __call__(self, rows: Sequence[ConstrainedRow], logits: torch.Tensor, stream=None) -> None:
        self.calls.append(([(r.row, r.new_token) for r in rows], tuple(logits.shape), stream))
        self.real(rows, logits, stream)


def regex_constraint(pattern: str) -> GrammarConstraint:
    grammar = LLMatcher.grammar_from_regex(pattern)
    return GrammarConstraint(LLMatcher(BYTE_TOKENIZER, grammar), grammar)


def make_engine(model_dir: Path, backend: str, postprocessor=None, max_model_len: int = 64, grammars=None,
                **overrides) -> TrtLlmEngine:
    config = TrtLlmEngineConfig(
        model_dir=str(model_dir), backend=backend, vocab_size=VOCAB, max_model_len=max_model_len, eos_token_id=EOS,
        **overrides,
    )
    return TrtLlmEngine(config, postprocessor, grammars)


def request(request_id: str, prompt: list[int], max_tokens: int = 8, constraint=None, **sampling) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, "stop_token_ids": frozenset({EOS}), **sampling})
    return GenerationRequest(request_id, prompt, params, constraint)


async def collect(engine: TrtLlmEngine, req: GenerationRequest) -> tuple[list[int], str, Optional[str]]:
    tokens: list[int] = []
    async for delta in engine.generate(req):
        tokens += delta.token_ids
        if delta.finish_reason:
            return tokens, delta.finish_reason, delta.error
    raise AssertionError("stream ended without a finish reason")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


# --- mapping ------------------------------------------------------------------------------


def test_greedy_maps_to_top_k_1_and_leaves_temperature_unset(fake_trt):
    kwargs = trt_sampling_kwargs(SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=frozenset({EOS})), 5, EOS)
    assert kwargs["top_k"] == 1 and "temperature" not in kwargs and "top_p" not in kwargs
    assert kwargs["end_id"] == EOS and kwargs["pad_id"] == EOS and "ignore_eos" not in kwargs
    assert kwargs["detokenize"] is False and kwargs["max_tokens"] == 5
    assert fake_trt.SamplingParams(**kwargs)._greedy_decoding


def test_sampling_maps_temperature_top_p_top_k_and_seed(fake_trt):
    ours = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, seed=123, stop_token_ids=frozenset({EOS}))
    kwargs = trt_sampling_kwargs(ours, 9, EOS)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"], kwargs["seed"]) == (0.7, 0.9, 40, 123)
    # no cut at all still passes top_p=1.0: with top_k and top_p unset TensorRT-LLM goes greedy
    plain = trt_sampling_kwargs(SamplingParams(max_tokens=9, temperature=1.0), 9, EOS)
    assert plain["top_p"] == 1.0 and "top_k" not in plain and "seed" not in plain
    assert not fake_trt.SamplingParams(**plain)._greedy_decoding


def test_penalties_pass_through_and_unsupported_controls_are_refused(fake_trt):
    ours = SamplingParams(max_tokens=9, temperature=0.5, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.2,
                          repetition_penalty=1.3, min_tokens=2)
    kwargs = trt_sampling_kwargs(ours, 9, EOS)
    assert (kwargs["min_p"], kwargs["presence_penalty"], kwargs["frequency_penalty"],
            kwargs["repetition_penalty"], kwargs["min_tokens"]) == (0.1, 0.5, -0.2, 1.3, 2)
    fake_trt.SamplingParams(**kwargs)  # the names exist in TensorRT-LLM's SamplingParams
    neutral = trt_sampling_kwargs(SamplingParams(max_tokens=9), 9, EOS)
    assert not {"min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"} & set(neutral)
    assert unsupported_sampling(ours, torch_sampler=False) is None  # the C++ sampler honours them
    for torch_sampler in (True, False):
        assert "logit_bias" in unsupported_sampling(SamplingParams(max_tokens=1, logit_bias={5: 1.0}), torch_sampler)
        assert "logprobs" in unsupported_sampling(SamplingParams(max_tokens=1, logprobs=2), torch_sampler)


@pytest.mark.parametrize(
    "controls, refused",
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"repetition_penalty": 1.2, "temperature": 0.0}, "repetition_penalty"),  # changes the argmax too
        ({"min_tokens": 2, "temperature": 0.0}, "min_tokens"),
        ({"min_p": 0.1}, "min_p"),
        ({"seed": 7}, "seed"),
        ({"min_p": 0.1, "temperature": 0.0}, None),  # no effect on an argmax
        ({"seed": 7, "temperature": 0.0}, None),
    ],
)
def test_what_torch_sampler_would_drop_is_refused_before_the_engine(fake_trt, model_dir, controls, refused):
    """TensorRT-LLM 1.2's TorchSampler reads temperature, top_p and top_k only and draws from one
    generator: a control it would drop is a 400 (EngineError), not a silent no-op."""

    async def main(backend: str):
        engine = make_engine(model_dir, backend)
        await engine.start()
        try:
            return await collect(engine, request("r", [10], max_tokens=3, **{"temperature": 0.8, **controls}))
        finally:
            submitted = len(engine._llm.submitted)
            await engine.shutdown()
            assert submitted == (0 if refused and backend == "pytorch" else 1)

    if refused is None:
        assert run(main("pytorch"))[1] == "length"
    else:
        with pytest.raises(EngineError, match=refused):
            run(main("pytorch"))
    assert run(main("tensorrt"))[1] == "length"  # the TensorRT engine's sampler honours them


def test_stop_tokens_pick_end_id_and_ignore_eos_without_any():
    eos_and_other = trt_sampling_kwargs(SamplingParams(max_tokens=3, stop_token_ids=frozenset({EOS, 7})), 3, EOS)
    assert eos_and_other["end_id"] == EOS and eos_and_other["stop_token_ids"] == [7]
    other_only = trt_sampling_kwargs(SamplingParams(max_tokens=3, stop_token_ids=frozenset({9, 7})), 3, EOS)
    assert other_only["end_id"] == 7 and other_only["stop_token_ids"] == [9] and "ignore_eos" not in other_only
    none = trt_sampling_kwargs(SamplingParams(max_tokens=3), 3, EOS)
    assert none["ignore_eos"] is True and "stop_token_ids" not in none


@pytest.mark.parametrize(
    "trt_reason, ours",
    [("stop", "stop"), ("length", "length"), ("cancelled", "abort"), ("timeout", "error"), (None, "error")],
)
def test_finish_reasons(trt_reason, ours):
    reason, error = finish_reason_of(trt_reason)
    assert reason == ours
    assert (error is not None) == (ours == "error")


def test_config_for_stored_model_picks_backend_and_paths(tmp_path):
    engine_cfg = config_for_stored_model(tmp_path, "tensorrt_llm_engine", 100, 512, 2, max_batch_size=16)
    assert engine_cfg.backend == "tensorrt" and engine_cfg.model_dir == str(tmp_path / "engine")
    assert engine_cfg.tokenizer_dir == str(tmp_path) and engine_cfg.max_batch_size == 16
    checkpoint_cfg = config_for_stored_model(tmp_path, "tensorrt_llm", 100, 512, 2)
    assert checkpoint_cfg.backend == "pytorch" and checkpoint_cfg.model_dir == str(tmp_path)
    with pytest.raises(ValueError):
        config_for_stored_model(tmp_path, "pytorch", 100, 512, 2)


# --- requests through the fake LLM ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_token_id_prompt_streams_without_a_tokenizer(fake_trt, model_dir, backend):
    async def main():
        engine = make_engine(model_dir, backend, kv_cache_max_tokens=4096, max_batch_size=4)
        await engine.start()
        tokens, reason, _ = await collect(engine, request("r1", [10], max_tokens=5))
        llm_kwargs = engine._llm.kwargs
        await engine.shutdown()
        return tokens, reason, llm_kwargs

    tokens, reason, llm_kwargs = run(main())
    assert tokens == [11, 12, 13, 14, 15] and reason == "length"
    assert llm_kwargs["skip_tokenizer_init"] is True and llm_kwargs["max_batch_size"] == 4
    assert llm_kwargs["kv_cache_config"].max_tokens == 4096
    assert llm_kwargs["kv_cache_config"].free_gpu_memory_fraction == 0.9
    assert ("disable_overlap_scheduler" in llm_kwargs) == (backend == "pytorch")


def test_stop_tokens_end_the_stream_and_are_not_emitted(fake_trt, model_dir):
    async def main():
        engine = make_engine(model_dir, "pytorch")
        await engine.start()
        # EOS is a stop token: the toy model walks 255, 256, ... 261 (EOS): END_ID
        by_end_id = await collect(engine, request("a", [255], max_tokens=20))
        # 258 is a stop token besides EOS: TensorRT-LLM's stop-word path, which trims it
        by_stop_word = await collect(engine, request("b", [255], max_tokens=20, stop_token_ids=frozenset({EOS, 258})))
        await engine.shutdown()
        return by_end_id, by_stop_word

    by_end_id, by_stop_word = run(main())
    assert by_end_id == ([256, 257, 258, 259, 260], "stop", None)
    assert by_stop_word == ([256, 257], "stop", None)


def test_prompt_checks_raise_engine_error(fake_trt, model_dir):
    async def main():
        engine = make_engine(model_dir, "pytorch")
        await engine.start()
        errors = []
        for req in (request("empty", []), request("long", [1] * 64), request("c", [1], constraint=regex_constraint("a"))):
            with pytest.raises(EngineError) as caught:
                await collect(engine, req)
            errors.append(str(caught.value))
        await engine.shutdown()
        return errors

    errors = run(main())
    assert "empty" in errors[0] and "at most 63" in errors[1] and "post-processor" in errors[2]


def test_abort_ends_the_stream_with_abort(fake_trt, model_dir):
    async def main():
        # A context far longer than the abort takes to land, even on a busy machine: the fake
        # executor runs its steps unthrottled on its own thread.
        engine = make_engine(model_dir, "pytorch", max_model_len=20_000)
        await engine.start()
        seen, reasons = [], []
        async for delta in engine.generate(request("long", [0], max_tokens=10_000)):
            seen += delta.token_ids
            if delta.finish_reason:
                reasons.append(delta.finish_reason)
            elif len(seen) >= 3 and engine.num_active == 1:
                engine.abort("long")
        active_after = engine.num_active
        executor = engine._llm.fake_executor
        await asyncio.sleep(0.05)
        leftover = executor.pending()
        await engine.shutdown()
        return seen, reasons, active_after, leftover

    seen, reasons, active_after, leftover = run(main())
    assert reasons == ["abort"] and 3 <= len(seen) < 10_000
    assert active_after == 0 and leftover == 0


def test_closing_the_stream_early_aborts_the_request(fake_trt, model_dir):
    async def main():
        engine = make_engine(model_dir, "tensorrt")
        await engine.start()
        stream = engine.generate(request("early", [0], max_tokens=10_000))
        first = await stream.__anext__()
        await stream.aclose()
        executor = engine._llm.fake_executor
        for _ in range(100):
            if not executor.pending():
                break
            await asyncio.sleep(0.01)
        result = (first.token_ids, engine.num_active, executor.pending())
        await engine.shutdown()
        return result

    first_tokens, active, leftover = run(main())
    # the first delta holds whatever was read before the consumer looked: one chunk from token 1
    assert first_tokens == list(range(1, len(first_tokens) + 1)) and active == 0 and leftover == 0


def test_streaming_starts_one_task_per_request_not_per_token(fake_trt, model_dir):
    """Each token costs the event loop no task of its own (nor an asyncio.wait over two)."""

    async def main():
        engine = make_engine(model_dir, "pytorch", max_model_len=256)
        await engine.start()
        loop = asyncio.get_running_loop()
        started = []

        def counting_factory(loop, coro, **kwargs):
            started.append(getattr(coro, "__qualname__", repr(coro)))
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(counting_factory)
        try:
            tokens, reason, _ = await collect(engine, request("r", [0], max_tokens=100))
        finally:
            loop.set_task_factory(None)
        await engine.shutdown()
        return tokens, reason, started

    tokens, reason, started = run(main())
    assert len(tokens) == 100 and reason == "length"
    assert started == ["TrtLlmEngine._read"]


def test_abort_ends_the_stream_without_waiting_for_tensorrt_llm(fake_trt, model_dir):
    async def main():
        engine = make_engine(model_dir, "pytorch", max_model_len=20_000)
        await engine.start()
        stream = engine.generate(request("stuck", [0], max_tokens=10_000))
        first = await stream.__anext__()
        engine._llm.fake_executor.shutdown()  # TensorRT-LLM answers nothing more, not even 'cancelled'
        engine.abort("stuck")
        rest = [delta async for delta in stream]
        active = engine.num_active
        await engine.shutdown()
        return first, rest, active

    first, rest, active = run(main())
    assert first.token_ids and first.finish_reason is None
    assert rest[-1].finish_reason == "abort" and all(d.finish_reason is None for d in rest[:-1])
    assert active == 0


def test_a_failing_executor_step_ends_the_stream_with_its_error(fake_trt, model_dir):
    class FailingPostProcessor:
        def __call__(self, rows, logits, stream=None) -> None:
            raise RuntimeError("mask kernel exploded")

    async def main():
        engine = make_engine(model_dir, "pytorch", FailingPostProcessor())
        await engine.start()
        deltas = [d async for d in engine.generate(request("f", [10], max_tokens=5, constraint=regex_constraint("a+")))]
        active, constrained = engine.num_active, len(engine.constrained)
        await engine.shutdown()
        return deltas, active, constrained

    deltas, active, constrained = run(main())
    assert len(deltas) == 1 and deltas[0].token_ids == [] and deltas[0].finish_reason == "error"
    assert "mask kernel exploded" in deltas[0].error
    assert active == 0 and constrained == 0


# --- context length -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_max_model_len_is_the_pytorch_backends_max_seq_len(fake_trt, model_dir, backend):
    async def main():
        engine = make_engine(model_dir, backend, max_model_len=48)
        await engine.start()
        llm_kwargs = engine._llm.kwargs
        await engine.shutdown()
        return llm_kwargs

    llm_kwargs = run(main())
    # a built engine's limit is its build_config.max_seq_len: TensorRT-LLM only warns about a runtime one
    assert llm_kwargs.get("max_seq_len") == (48 if backend == "pytorch" else None)


def test_max_model_len_beyond_the_built_engines_max_seq_len_is_refused(fake_trt, model_dir):
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "build_config": {"max_seq_len": 32}}))

    async def start(max_model_len: int) -> None:
        engine = make_engine(model_dir, "tensorrt", max_model_len=max_model_len)
        await engine.start()
        await engine.shutdown()

    run(start(32))
    with pytest.raises(EngineError, match="build max_seq_len 32"):
        run(start(33))


# --- constraints ----------------------------------------------------------------------------


def test_tensorrt_backend_registers_the_batched_processor_and_masks(fake_trt, model_dir):
    postprocessor = RecordingPostProcessor()

    async def main():
        engine = make_engine(model_dir, "tensorrt", postprocessor)
        await engine.start()
        constraint = regex_constraint("[a-c]{4}")
        result = await collect(engine, request("c", [10], max_tokens=20, constraint=constraint))
        handed = engine._llm.kwargs["batched_logits_processor"]
        await engine.shutdown()
        return result, handed, engine, constraint

    (tokens, reason, _), handed, engine, constraint = run(main())
    # the toy model prefers 11, 12, ...; the grammar allows a-c then EOS only
    assert tokens == [97, 98, 99, 97] and reason == "stop"
    assert handed is engine.batched_processor and handed.postprocessor is postprocessor
    import os

    assert os.environ["TLLM_WORKER_USE_SINGLE_PROCESS"] == "1"
    # each step committed exactly the newest token, once
    assert [rows for rows, _, _ in postprocessor.calls] == [[(0, None)], [(0, 97)], [(0, 98)], [(0, 99)], [(0, 97)]]
    assert all(shape == (1, VOCAB) and stream is None for _, shape, stream in postprocessor.calls)
    assert constraint.matcher.is_accepting() and constraint.error is None
    assert len(engine.constrained) == 0


def test_pytorch_backend_uses_per_request_processors(fake_trt, model_dir):
    postprocessor = RecordingPostProcessor()

    async def main():
        engine = make_engine(model_dir, "pytorch", postprocessor)
        await engine.start()
        result = await collect(engine, request("c", [10], max_tokens=20, constraint=regex_constraint("[a-c]{4}")))
        llm_kwargs = engine._llm.kwargs
        await engine.shutdown()
        return result, llm_kwargs, engine

    (tokens, reason, _), llm_kwargs, engine = run(main())
    assert tokens == [97, 98, 99, 97] and reason == "stop"
    assert "batched_logits_processor" not in llm_kwargs and llm_kwargs["disable_overlap_scheduler"] is True
    assert engine.batched_processor is None
    assert [rows for rows, _, _ in postprocessor.calls][:2] == [[(0, None)], [(0, 97)]]
    assert all(shape == (1, VOCAB) for _, shape, _ in postprocessor.calls)


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_beam_shaped_logits_are_masked_on_every_row(fake_trt, model_dir, backend, monkeypatch):
    monkeypatch.setattr(fake_trt.LLM, "beam_rows", 3, raising=False)
    from tensorrt_llm._tensorrt_engine import LLM as TrtLLM

    monkeypatch.setattr(TrtLLM, "beam_rows", 3)
    postprocessor = RecordingPostProcessor()

    async def main():
        engine = make_engine(model_dir, backend, postprocessor)
        await engine.start()
        result = await collect(engine, request("b", [10], max_tokens=20, constraint=regex_constraint("[a-c]{4}")))
        await engine.shutdown()
        return result

    assert run(main()) == ([97, 98, 99, 97], "stop", None)
    assert postprocessor.calls  # beam 0 went through our post-processor


def test_concurrent_constrained_requests_share_one_batched_call(fake_trt, model_dir):
    postprocessor = RecordingPostProcessor()

    async def main():
        engine = make_engine(model_dir, "tensorrt", postprocessor)
        await engine.start()
        results = await asyncio.gather(
            collect(engine, request("x", [10], max_tokens=30, constraint=regex_constraint("[x-z]{6}"))),
            collect(engine, request("y", [10], max_tokens=30, constraint=regex_constraint("[a-c]{6}"))),
            collect(engine, request("free", [10], max_tokens=6)),
        )
        await engine.shutdown()
        return results

    x, y, free = run(main())
    assert x == ([120, 121, 122, 120, 121, 122], "stop", None)
    assert y == ([97, 98, 99, 97, 98, 99], "stop", None)
    assert free == ([11, 12, 13, 14, 15, 16], "length", None)
    assert max(len(rows) for rows, _, _ in postprocessor.calls) == 2


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_a_failed_constraint_ends_its_request_with_an_error(fake_trt, model_dir, backend):
    async def main():
        engine = make_engine(model_dir, backend, MaskPostProcessor(BYTE_TOKENIZER, num_threads=2))
        await engine.start()
        broken = regex_constraint("[a-c]{4}")
        broken.fail("grammar blew a parser limit")
        results = await asyncio.gather(
            collect(engine, request("bad", [10], max_tokens=20, constraint=broken)),
            collect(engine, request("good", [10], max_tokens=20, constraint=regex_constraint("[a-c]{2}"))),
        )
        await engine.shutdown()
        return results

    bad, good = run(main())
    assert bad == ([], "error", "grammar blew a parser limit")
    assert good == ([97, 98], "stop", None)


# --- processors, called as TensorRT-LLM calls them ------------------------------------------


def _session(postprocessor) -> ProcessorSession:
    return ProcessorSession(ConstrainedRequests(), postprocessor)


def _allowed(row: torch.Tensor) -> list[int]:
    return torch.nonzero(~torch.isneginf(row)).flatten().tolist()


@pytest.mark.parametrize("shared_buffer", [True, False])
def test_batched_processor_masks_beam_rows_and_leaves_others(shared_buffer):
    postprocessor = RecordingPostProcessor()
    session = _session(postprocessor)
    processor = BatchedConstraintProcessor(session)
    session.requests.add(7, regex_constraint("[a-c]+"), prompt_len=2, end_id=EOS)
    session.requests.add(8, regex_constraint("[x-z]+"), prompt_len=2, end_id=EOS)
    if shared_buffer:  # how TensorRT-LLM hands them out: slices of one buffer
        buffer = torch.randn(3 * 2, VOCAB)
        logits = [buffer[i * 2 : (i + 1) * 2].unsqueeze(1) for i in range(3)]
    else:
        logits = [torch.randn(2, 1, VOCAB) for _ in range(3)]
    untouched = logits[2].clone()
    token_ids = [[[1, 2]] * 2, [[1, 2]] * 2, [[1, 2]] * 2]
    processor([101, 102, 103], logits, token_ids, 0, [7, 8, 99])
    for beam in range(2):
        assert _allowed(logits[0][beam, 0]) == ABC
        assert _allowed(logits[1][beam, 0]) == [120, 121, 122]
    assert torch.equal(logits[2], untouched)  # client id 99 is not a constrained request
    assert postprocessor.calls[0][:2] == ([(0, None), (1, None)], (3, VOCAB))
    # a repeated call in the same step commits nothing; the next step commits the newest token
    processor([101], [torch.randn(1, 1, VOCAB)], [[[1, 2]]], 0, [7])
    processor([101], [torch.randn(1, 1, VOCAB)], [[[1, 2, 98]]], 0, [7])
    assert [rows for rows, _, _ in postprocessor.calls[1:]] == [[(0, None)], [(0, 98)]]


def test_out_of_sync_sequence_forces_the_end_token():
    session = _session(RecordingPostProcessor())
    tracked = session.requests.add(7, regex_constraint("[a-c]+"), prompt_len=2, end_id=EOS)
    logits = [torch.randn(1, 1, VOCAB)]
    BatchedConstraintProcessor(session)([1], logits, [[[1, 2, 97, 98]]], 0, [7])
    assert _allowed(logits[0][0, 0]) == [EOS]
    assert "out of sync" in tracked.error


def test_cpu_logits_get_no_stream():
    postprocessor = RecordingPostProcessor()
    session = _session(postprocessor)
    session.requests.add(7, regex_constraint("a"), prompt_len=1, end_id=EOS)
    BatchedConstraintProcessor(session)([1], [torch.randn(1, 1, VOCAB)], [[[5]]], 1234, [7])
    assert postprocessor.calls[0][2] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_are_masked_on_the_external_stream():
    postprocessor = RecordingPostProcessor()
    session = _session(postprocessor)
    session.requests.add(7, regex_constraint("[a-c]+"), prompt_len=1, end_id=EOS)
    side = torch.cuda.Stream()
    logits = [torch.randn(1, 1, VOCAB, device="cuda")]
    torch.cuda.synchronize()
    BatchedConstraintProcessor(session)([1], logits, [[[5]]], side.cuda_stream, [7])
    stream = postprocessor.calls[0][2]
    assert isinstance(stream, torch.cuda.ExternalStream) and stream.cuda_stream == side.cuda_stream
    side.synchronize()
    assert _allowed(logits[0][0, 0].cpu()) == ABC


def test_copy_mask_to_other_beams():
    beams = torch.zeros(3, 5)
    beams[0, [1, 3]] = float("-inf")
    copy_mask_to_other_beams(beams)
    assert all(_allowed(beams[b]) == [0, 2, 4] for b in range(3))


def test_per_request_processor_pickles_to_plain_data_only():
    settings = GrammarSettings.of(GrammarCompiler(BYTE_TOKENIZER), "/models/x")
    grammar = WorkerGrammar("start: /[a-c]+/", settings)
    processor = RequestConstraintProcessor("session", "req-1", EOS, grammar)
    clone = pickle.loads(pickle.dumps(processor))
    assert (clone.session_id, clone.key, clone.end_id, clone.worker_grammar) == ("session", "req-1", EOS, grammar)
    # unpickled where no session "session" exists, it is a worker's copy: it starts building the
    # constraint at once (here it fails: there is no /models/x), off the caller's thread
    assert isinstance(clone._worker_build.exception(timeout=120), OSError)
    # TensorRT-LLM pickles every request's processors, also at TP 1 without grammar settings
    bare = pickle.loads(pickle.dumps(RequestConstraintProcessor("session", "req-2", EOS)))
    assert (bare.key, bare.worker_grammar) == ("req-2", None)


def test_per_request_processor_leaves_a_request_that_ended_here_alone():
    """TensorRT-LLM may run one more step for a request the adapter already removed (aborted):
    the serving process must not mistake itself for a worker and rebuild its constraint."""
    from llgtrt_core.engine.trtllm_processors import register_session, unregister_session

    register_session("serving", _session(RecordingPostProcessor()))
    try:
        settings = GrammarSettings.of(GrammarCompiler(BYTE_TOKENIZER), "/nonexistent")
        processor = RequestConstraintProcessor("serving", "gone", EOS, WorkerGrammar("start: /a/", settings))
        logits = torch.randn(1, 1, VOCAB)
        untouched = logits.clone()
        processor(1, logits, [[5, 97]], None, None)
    finally:
        unregister_session("serving")
    assert torch.equal(logits, untouched)


# --- the serving process's constraint settings in TensorRT-LLM's worker processes -------------

TIGHT_LIMITS = {"step_max_items": 50}
AMBIGUOUS = 'start: s\ns: s s | "a"'  # Earley items grow with every "a"


def test_grammar_settings_are_read_off_the_serving_processs_compiler(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    padded_vocab, eos_override = len(hf) + 64, (7, 5)  # config tokenizer.n_vocab_override, eos_token_ids
    compiler = GrammarCompiler(build_ll_tokenizer(hf, padded_vocab, eos_override), limits=TIGHT_LIMITS, log_level=1)
    settings = GrammarSettings.of(compiler, str(smollm2_tokenizer_dir))
    assert (settings.vocab_size, settings.eos_token_ids, settings.log_level) == (padded_vocab, eos_override, 1)
    assert dict(settings.limits)["step_max_items"] == 50
    assert dict(settings.limits)["max_items_in_row"] == compiler.limits.max_items_in_row  # the rest as compiled
    compiler.close()


def test_the_engine_hands_its_compilers_settings_to_per_request_processors(fake_trt, model_dir):
    compiler = GrammarCompiler(BYTE_TOKENIZER, limits=TIGHT_LIMITS)
    constraint = regex_constraint("[a-c]{2}")

    async def main():
        engine = make_engine(model_dir, "pytorch", RecordingPostProcessor(), grammars=compiler,
                             tokenizer_dir="/models/x")
        await engine.start()
        result = await collect(engine, request("c", [10], max_tokens=20, constraint=constraint))
        processor = engine._llm.submitted[0].logits_processor
        await engine.shutdown()
        return result, processor

    result, processor = run(main())
    assert result == ([97, 98], "stop", None)
    assert processor.worker_grammar == WorkerGrammar(constraint.grammar, GrammarSettings.of(compiler, "/models/x"))
    compiler.close()


def test_constrained_requests_in_worker_processes_need_the_grammar_settings(fake_trt, model_dir):
    async def main():
        engine = make_engine(model_dir, "pytorch", RecordingPostProcessor(), single_process=False)
        await engine.start()
        try:
            with pytest.raises(EngineError, match="grammar compiler"):
                await collect(engine, request("c", [10], constraint=regex_constraint("a")))
        finally:
            await engine.shutdown()

    run(main())


def _worker_masks(settings: GrammarSettings, grammar: str, token: int, steps: int, end_id: int = 7) -> list[list[int]]:
    """The allowed tokens per step of a processor running where no session is registered (a
    TensorRT-LLM worker process), committing `token` each step."""
    processor = RequestConstraintProcessor("not-registered", "k", end_id, WorkerGrammar(grammar, settings))
    processor = pickle.loads(pickle.dumps(processor))
    sequence, allowed = [0], []
    for _ in range(steps):
        logits = torch.randn(1, 1, settings.vocab_size)
        processor(1, logits, [sequence], None, None)
        allowed.append(_allowed(logits[0, 0]))
        sequence = sequence + [token]
    return allowed


def test_a_worker_process_rebuilds_constraints_with_the_serving_processs_settings(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    a = hf.convert_tokens_to_ids("a")
    padded_vocab, eos_override = len(hf) + 64, (7, 5)
    tight = GrammarCompiler(build_ll_tokenizer(hf, padded_vocab, eos_override), limits=TIGHT_LIMITS)
    settings = GrammarSettings.of(tight, str(smollm2_tokenizer_dir))

    # the overridden logits width and EOS ids: "a" then the configured EOS tokens only
    assert _worker_masks(settings, LLMatcher.grammar_from_regex("a"), a, 2) == [[a], sorted(eos_override)]
    # the configured parser limits: the ambiguous grammar fails (the request's end token only) within 60 tokens...
    assert [7] in _worker_masks(settings, LLMatcher.grammar_from_lark(AMBIGUOUS), a, 60)
    # ...where llguidance's defaults let it go on
    default_limits = GrammarSettings.of(GrammarCompiler(build_ll_tokenizer(hf, padded_vocab, eos_override)),
                                        str(smollm2_tokenizer_dir))
    assert all(a in allowed for allowed in _worker_masks(default_limits, LLMatcher.grammar_from_lark(AMBIGUOUS), a, 60))
    tight.close()


# --- TensorRT-LLM 1.2 as its source reads (issue 21) -------------------------------------------


def test_per_request_processors_survive_the_broadcast_at_tp1_without_grammar_settings(fake_trt, model_dir):
    """1.2's executor broadcasts each new request's processors through MPIDist.broadcast, which
    pickles them even at TP 1 in-process: a processor that cannot pickle fails the executor."""
    postprocessor = RecordingPostProcessor()

    async def main():
        engine = make_engine(model_dir, "pytorch", postprocessor)  # no grammar compiler, as in test_trtllm_real
        await engine.start()
        result = await collect(engine, request("c", [10], max_tokens=20, constraint=regex_constraint("[a-c]{3}")))
        errors = engine._llm.fake_executor.errors
        await engine.shutdown()
        return result, errors

    result, errors = run(main())
    assert errors == [] and result == ([97, 98, 99], "stop", None)
    assert postprocessor.calls  # the unpickled copy found the serving process's session


def test_generate_async_refusals_become_engine_errors(fake_trt, model_dir):
    async def main():
        # TensorRT-LLM's own limit (here set through extra_llm_args, unknown to our pre-check)
        engine = make_engine(model_dir, "pytorch", extra_llm_args={"max_num_tokens": 16})
        await engine.start()
        errors = []
        with pytest.raises(EngineError) as caught:
            await collect(engine, request("long", [1] * 20))
        errors.append(str(caught.value))
        engine._llm.fake_executor.shutdown()
        engine._llm._executor = None  # TensorRT-LLM shut down under us
        with pytest.raises(EngineError) as caught:
            await collect(engine, request("late", [1]))
        errors.append(str(caught.value))
        engine._llm = None
        return errors

    too_long, shut_down = run(main())
    assert "max_num_tokens (16)" in too_long and "shutting down" in shut_down


def test_prompts_over_max_num_tokens_are_refused_before_tensorrt_llm(fake_trt, model_dir):
    async def main(**overrides):
        engine = make_engine(model_dir, "pytorch", max_model_len=20_000, **overrides)
        await engine.start()
        try:
            return await collect(engine, request("p", [1] * 8193, max_tokens=2))
        finally:
            submitted = len(engine._llm.submitted)
            await engine.shutdown()
            assert submitted == (1 if overrides else 0)

    with pytest.raises(EngineError, match="max_num_tokens = 8192"):
        run(main())
    assert run(main(enable_chunked_prefill=True))[1] == "length"


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_a_failed_constraint_forces_the_requests_own_end_token(backend):
    """The EOS-only mask allows llguidance's EOS; TensorRT-LLM ends a request on its end_id only."""
    session = _session(MaskPostProcessor(BYTE_TOKENIZER, num_threads=2))
    broken = regex_constraint("[a-c]+")
    broken.fail("parser limit")
    logits = torch.randn(1, 1, VOCAB)
    if backend == "tensorrt":
        session.requests.add(7, broken, prompt_len=1, end_id=258)
        BatchedConstraintProcessor(session)([1], [logits], [[[5]]], 0, [7])
    else:
        from llgtrt_core.engine.trtllm_processors import register_session, unregister_session

        register_session("own-end", session)
        try:
            session.requests.add("k", broken, prompt_len=1, end_id=258)
            RequestConstraintProcessor("own-end", "k", 258)(1, logits, [[5]], None, None)
        finally:
            unregister_session("own-end")
    assert _allowed(logits[0, 0]) == [258]


def test_a_failed_request_does_not_emit_its_forced_end_token(fake_trt, model_dir):
    async def main():
        engine = make_engine(model_dir, "pytorch", MaskPostProcessor(BYTE_TOKENIZER, num_threads=2))
        await engine.start()
        broken = regex_constraint("[a-c]{4}")
        broken.fail("grammar blew a parser limit")
        # 258 is the request's end token (its only stop token), not the engine's EOS
        result = await collect(engine, request("bad", [10], max_tokens=20, constraint=broken,
                                               stop_token_ids=frozenset({258})))
        await engine.shutdown()
        return result

    assert run(main()) == ([], "error", "grammar blew a parser limit")


def test_overlap_scheduler_is_disabled_only_when_constrained_requests_can_arrive(fake_trt, model_dir):
    async def llm_kwargs(postprocessor=None, **overrides):
        engine = make_engine(model_dir, "pytorch", postprocessor, **overrides)
        await engine.start()
        kwargs = engine._llm.kwargs
        await engine.shutdown()
        return kwargs["disable_overlap_scheduler"]

    assert run(llm_kwargs()) is False  # nothing constrained: TensorRT-LLM keeps its overlap scheduler
    assert run(llm_kwargs(RecordingPostProcessor())) is True
    assert run(llm_kwargs(RecordingPostProcessor(), disable_overlap_scheduler=False)) is False


def test_unconstrained_streams_survive_the_overlap_schedulers_lag(fake_trt, model_dir):
    async def main():
        engine = make_engine(model_dir, "pytorch")
        await engine.start()
        results = await asyncio.gather(collect(engine, request("a", [255], max_tokens=20)),
                                       collect(engine, request("b", [10], max_tokens=4)))
        await engine.shutdown()
        return results

    assert run(main()) == [([256, 257, 258, 259, 260], "stop", None), ([11, 12, 13, 14], "length", None)]


@pytest.mark.parametrize("overrides", [{"disable_overlap_scheduler": False},
                                       {"extra_llm_args": {"disable_overlap_scheduler": False}}])
def test_constrained_requests_are_refused_while_the_overlap_scheduler_is_on(fake_trt, model_dir, overrides):
    """With it on, processors see each sequence a step behind (the fake lags as 1.2 does)."""

    async def main():
        engine = make_engine(model_dir, "pytorch", RecordingPostProcessor(), **overrides)
        await engine.start()
        try:
            assert engine._llm.kwargs["disable_overlap_scheduler"] is False
            with pytest.raises(EngineError, match="overlap scheduler"):
                await collect(engine, request("c", [10], max_tokens=20, constraint=regex_constraint("[a-c]{6}")))
            return await collect(engine, request("free", [10], max_tokens=3))
        finally:
            await engine.shutdown()

    assert run(main()) == ([11, 12, 13], "length", None)


def test_a_prompt_prefilled_in_several_chunks_commits_nothing_twice():
    """With chunked prefill a processor may be called once per prompt chunk before any token."""
    postprocessor = RecordingPostProcessor()
    from llgtrt_core.engine.trtllm_processors import register_session, unregister_session

    session = _session(postprocessor)
    register_session("chunks", session)
    try:
        tracked = session.requests.add("k", regex_constraint("[a-c]+"), prompt_len=3, end_id=EOS)
        processor = RequestConstraintProcessor("chunks", "k", EOS)
        for sequence in ([1, 2, 3], [1, 2, 3], [1, 2, 3, 97]):
            processor(1, torch.randn(1, 1, VOCAB), [sequence], None, None)
    finally:
        unregister_session("chunks")
    assert [rows for rows, _, _ in postprocessor.calls] == [[(0, None)], [(0, None)], [(0, 97)]]
    assert tracked.error is None


def test_pytorch_backend_processors_get_model_dtype_rows(fake_trt, model_dir):
    """1.2's PyTorch backend hands each request (1, 1, V) rows of the model's (bfloat16) logits."""
    real = MaskPostProcessor(BYTE_TOKENIZER, num_threads=2)
    seen = []

    def recording(rows, logits, stream=None):
        seen.append((logits.dtype, tuple(logits.shape)))
        real(rows, logits, stream)

    async def main():
        engine = make_engine(model_dir, "pytorch", recording)
        await engine.start()
        result = await collect(engine, request("c", [10], max_tokens=20, constraint=regex_constraint("[a-c]{2}")))
        await engine.shutdown()
        return result

    assert run(main()) == ([97, 98], "stop", None)
    assert set(seen) == {(torch.bfloat16, (1, VOCAB))}


@pytest.mark.parametrize("backend", ["pytorch", "tensorrt"])
def test_several_tokens_per_step_end_a_constrained_request_with_an_error(fake_trt, model_dir, backend, monkeypatch):
    from tensorrt_llm._tensorrt_engine import LLM as TrtLLM

    for cls in (fake_trt.LLM, TrtLLM):
        monkeypatch.setattr(cls, "tokens_per_step", 2)

    async def main():
        engine = make_engine(model_dir, backend, RecordingPostProcessor())
        await engine.start()
        results = await asyncio.gather(
            collect(engine, request("c", [10], max_tokens=20, constraint=regex_constraint("[a-c]{6}"))),
            collect(engine, request("free", [10], max_tokens=6)),
        )
        await engine.shutdown()
        return results

    (tokens, reason, error), free = run(main())
    assert reason == "error" and "grew by 2" in error
    assert free == ([11, 12, 13, 14, 15, 16], "length", None)


def test_tensor_parallel_workers_import_llgtrt_core_and_mask_on_every_rank(fake_trt, tmp_path,
                                                                          smollm2_tokenizer_dir, monkeypatch):
    """TP 2: the executor runs in a fresh worker process that gets only the environment (no
    llgtrt_core on its path unless we put it there, as for processes a launcher starts; 1.2's
    MpiPoolSession also passes sys.path), each rank unpickles and runs its own processors, which
    rebuild the constraint."""
    from transformers import AutoTokenizer

    monkeypatch.delenv("PYTHONPATH", raising=False)
    hf = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    ll_tokenizer = build_ll_tokenizer(hf, len(hf), [hf.eos_token_id])
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": ll_tokenizer.vocab_size}))
    compiler = GrammarCompiler(ll_tokenizer)
    prompt = hf.encode("hello")

    async def main():
        config = TrtLlmEngineConfig(model_dir=str(tmp_path), backend="pytorch", vocab_size=ll_tokenizer.vocab_size,
                                    max_model_len=64, eos_token_id=hf.eos_token_id,
                                    tokenizer_dir=str(smollm2_tokenizer_dir), tensor_parallel_size=2)
        engine = TrtLlmEngine(config, MaskPostProcessor(ll_tokenizer, num_threads=2), compiler)
        await engine.start()
        try:
            grammar = LLMatcher.grammar_from_regex("[a-c]{2}")
            constraint = GrammarConstraint(LLMatcher(ll_tokenizer, grammar), grammar)
            params = dict(stop_token_ids=frozenset({hf.eos_token_id}))
            return await collect(engine, request("c", prompt, max_tokens=10, constraint=constraint, **params)), \
                [p.max_tokens for p in engine._llm.submitted]
        finally:
            await engine.shutdown()

    (tokens, reason, error), submitted = run(main())
    compiler.close()
    assert (reason, error) == ("stop", None) and len(hf.decode(tokens)) == 2 and set(hf.decode(tokens)) <= set("abc")
    assert submitted == [1, 10]  # the start-up request had every worker build its llguidance tokenizer


def test_the_service_config_reaches_tensor_parallelism(tmp_path):
    from llgtrt_core.config import Config, RuntimeConfig
    from llgtrt_core.engine.factory import create_engine

    metadata = {"engine": "tensorrt_llm", "vocab_size": VOCAB, "context_length": 128}
    compiler = GrammarCompiler(BYTE_TOKENIZER)
    config = Config(runtime=RuntimeConfig(tensor_parallel_size=2))
    engine = create_engine(tmp_path, metadata, config, VOCAB, [EOS], EOS, compiler)
    compiler.close()
    assert engine.config.tensor_parallel_size == 2 and not engine.config.in_process
