"""The mask fill in a process of its own (constraints/fill_process.py), on the real default model
with real llguidance, on the CPU (on a GPU it is the default): the same greedy output as the fill
in the engine's process, each constrained answer valid against its schema, loop guards and
length limits steering there, a finished request's constraint dropped there, and a fill process
that dies failing the constrained rows only."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import jsonschema
import llguidance
import psutil
import pytest

from llgtrt_core.config import LlguidanceConfig
from llgtrt_core.constraints import GrammarCompiler, GrammarConstraint, build_ll_tokenizer
from llgtrt_core.constraints.fill_process import RemoteMaskPostProcessor
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from llgtrt_core.engine.interface import ConstrainedRow, GenerationRequest, LoopGuardSettings, SamplingParams
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.tokenizer import Tokenizer
from tests.bento_server import bentoml_serve
from tests.test_fast_forward import SCHEMA, tokenizer  # noqa: F401 (the fixture: the default model's)
from tests.test_loop_guard import allowed

QUESTIONS = ["Describe a person as JSON.", "Who lives in Berlin? Answer in JSON.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def vocab_size(stored_model_dir: Path) -> int:
    return json.loads((stored_model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    return build_ll_tokenizer(tokenizer.hf, vocab_size, sorted(tokenizer.eos_token_ids))


def chat_prompt(tokenizer: Tokenizer, question: str) -> list[int]:
    ids = tokenizer.hf.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def remote(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer, vocab_size: int,
           tmp_path: Path) -> RemoteMaskPostProcessor:
    return RemoteMaskPostProcessor.start(str(stored_model_dir), ll_tokenizer, vocab_size,
                                         sorted(tokenizer.eos_token_ids), LlguidanceConfig(), 4,
                                         str(tmp_path / "fill.sock"))


def schema_constraint(compiler: GrammarCompiler) -> GrammarConstraint:
    """A fresh constraint of SCHEMA's grammar, compiled by `compiler`."""
    return compiler.new_constraint(compiler.compile_future(json_schema_grammar(SCHEMA)).result())


Result = tuple[list[int], Optional[str], Optional[str]]


def run(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer, post_processor: MaskPostProcessor,
        max_tokens: int = 100, overlap_steps: bool = False, guard: Optional[LoopGuardSettings] = None,
        between=None) -> list[Result]:
    """QUESTIONS' requests at once (the last unconstrained), greedy, float32: tokens, finish, error."""

    async def generate() -> list[Result]:
        compiler = GrammarCompiler(ll_tokenizer)
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", dtype="float32", max_batch_size=4,
                                                                 fast_forward=False, overlap_steps=overlap_steps),
                             post_processor)
        await engine.start()
        try:
            compiled = await compiler.compile(json_schema_grammar(SCHEMA))

            async def one(i: int, question: str) -> Result:
                constraint = compiler.new_constraint(compiled, loop_guard=guard) if i < 2 else None
                sampling = SamplingParams(temperature=0.0, stop_token_ids=tokenizer.eos_token_ids,
                                          max_tokens=max_tokens)
                tokens, reason, error = [], None, None
                async for delta in engine.generate(GenerationRequest(f"r{i}", chat_prompt(tokenizer, question),
                                                                     sampling, constraint)):
                    tokens += delta.token_ids
                    reason, error = delta.finish_reason, delta.error
                    if between is not None and len(tokens) == 5:
                        between()
                if constraint is not None and isinstance(post_processor, RemoteMaskPostProcessor):
                    post_processor.release(constraint)  # as the engine process does at a request's end
                return tokens, reason, error

            return list(await asyncio.gather(*(one(i, q) for i, q in enumerate(QUESTIONS))))
        finally:
            await engine.shutdown()
            compiler.close()

    return asyncio.run(generate())


@pytest.mark.parametrize("overlap_steps", [False, True])
def test_same_greedy_output_as_the_fill_in_the_engines_process(stored_model_dir: Path, ll_tokenizer,
                                                               tokenizer: Tokenizer, vocab_size: int,
                                                               tmp_path: Path, overlap_steps: bool) -> None:
    local = run(stored_model_dir, ll_tokenizer, tokenizer, MaskPostProcessor(ll_tokenizer, max_batch_size=4),
                overlap_steps=overlap_steps)
    fill_process = remote(stored_model_dir, ll_tokenizer, tokenizer, vocab_size, tmp_path)
    try:
        remote_results = run(stored_model_dir, ll_tokenizer, tokenizer, fill_process, overlap_steps=overlap_steps)
        assert not fill_process._ids, "finished requests' constraints are dropped"
    finally:
        fill_process.close()
    assert remote_results == local
    assert_valid(remote_results, tokenizer)


def test_length_limits_steer_in_the_fill_process(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer,
                                                vocab_size: int, tmp_path: Path) -> None:
    """Near max_tokens the loop guard there marks the rows `closing` here, and the upload narrows
    their masks to the nearest ending: the answers close before the limit, as in-process."""
    guard = LoopGuardSettings(max_tokens=30)
    local = run(stored_model_dir, ll_tokenizer, tokenizer, MaskPostProcessor(ll_tokenizer, max_batch_size=4),
                max_tokens=30, guard=guard)
    fill_process = remote(stored_model_dir, ll_tokenizer, tokenizer, vocab_size, tmp_path)
    try:
        remote_results = run(stored_model_dir, ll_tokenizer, tokenizer, fill_process, max_tokens=30, guard=guard)
    finally:
        fill_process.close()
    assert remote_results == local
    for tokens, reason, _ in remote_results[:2]:
        assert reason == "stop"
        json.loads(tokenizer.decode(tokens))


def assert_valid(results: list[Result], tokenizer: Tokenizer) -> None:
    """The constrained answers (the first two) complete and valid, the plain one ended as usual."""
    for tokens, reason, error in results[:2]:
        assert reason == "stop" and error is None
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)
    assert results[2][1] in ("stop", "length") and results[2][2] is None


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_a_failed_fill_process_fails_its_constrained_rows_only_and_is_replaced(
        stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer, vocab_size: int, tmp_path: Path,
        fault: str) -> None:
    """Killed, or silent past the answer timeout (stopped): the constrained rows it held end with an
    error, the plain one goes on, and a new fill process serves the next requests' constraints."""
    fill_process = remote(stored_model_dir, ll_tokenizer, tokenizer, vocab_size, tmp_path)
    fill_process.answer_timeout_s = 3
    first = fill_process._process
    faulted: list[int] = []

    def fault_once() -> None:  # called at each request's fifth token: the first fault only
        if not faulted:
            faulted.append(first.pid)
            first.kill() if fault == "dies" else os.kill(first.pid, signal.SIGSTOP)

    try:
        results = run(stored_model_dir, ll_tokenizer, tokenizer, fill_process, max_tokens=40, between=fault_once)
        again = run(stored_model_dir, ll_tokenizer, tokenizer, fill_process)
        assert fill_process._process is not first and not first.is_alive()
    finally:
        fill_process.close()
    for tokens, reason, error in results[:2]:
        assert reason == "error" and "mask fill" in error
        assert ("did not answer within 3 s" if fault == "stalls" else "is gone") in error
    assert results[2][1] in ("stop", "length") and results[2][2] is None
    assert_valid(again, tokenizer)


def test_a_fill_process_killed_between_requests_costs_no_request(stored_model_dir: Path, ll_tokenizer,
                                                                 tokenizer: Tokenizer, vocab_size: int,
                                                                 tmp_path: Path) -> None:
    """Killed while no fill was on its way, it held no live constraint: the first fill after its death
    finds it gone, a new one starts, and that fill is sent there; every answer is complete and valid."""
    fill_process = remote(stored_model_dir, ll_tokenizer, tokenizer, vocab_size, tmp_path)
    try:
        assert_valid(run(stored_model_dir, ll_tokenizer, tokenizer, fill_process), tokenizer)
        first = fill_process._process
        first.kill()
        first.join(10)
        assert_valid(run(stored_model_dir, ll_tokenizer, tokenizer, fill_process), tokenizer)
        assert fill_process._process is not first and fill_process._process.is_alive()
    finally:
        fill_process.close()


def test_the_server_runs_the_fill_process_when_configured(bentoml_home: Path, tmp_path: Path) -> None:
    """LLGTRT_FILL_PROCESS=true (by default only where the engine runs on CUDA): the engine process
    spawns the fill process, and constrained answers through the openai client stay valid, also
    after the fill process is killed (a new one serves them)."""
    import openai

    with bentoml_serve(".", bentoml_home, tmp_path / "bentoml-serve.log", env={"LLGTRT_FILL_PROCESS": "true"}) as server:
        engines = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                   if "llgtrt_core.engine.core_process" in " ".join(p.cmdline())]

        def fill_processes() -> list[psutil.Process]:
            return [p for p in engines[0].children() if "multiprocessing.spawn" in " ".join(p.cmdline())]

        assert len(engines) == 1 and len(fill_processes()) == 1, server.log_tail()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
        for question in [*QUESTIONS[:2], "kill", QUESTIONS[0]]:
            if question == "kill":
                first = fill_processes()[0]
                first.kill()
                while first.is_running() and first.status() != psutil.STATUS_ZOMBIE:  # dead, not yet reaped
                    time.sleep(0.05)
                continue
            answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                    response_format=response_format, max_tokens=100, temperature=0)
            assert answer.choices[0].finish_reason == "stop", server.log_tail()
            jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
        assert [p.pid for p in fill_processes()] != [first.pid] and len(fill_processes()) == 1


def test_a_sent_fill_answers_every_thread_that_asks(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer,
                                                   vocab_size: int, tmp_path: Path) -> None:
    """On CUDA the fill's thread takes a sent fill's answer (to open the gate) while the engine
    thread may ask for it too (a step whose draw did not wait for it): each caller gets the answer
    once it has come. Two readers of the connection stalled a server for good (one waited for a
    second answer), and a caller passing the reader returned before the answer came."""
    fill_process = remote(stored_model_dir, ll_tokenizer, tokenizer, vocab_size, tmp_path)
    compiler = GrammarCompiler(ll_tokenizer)
    callers = ThreadPoolExecutor(2)
    try:
        constraint = schema_constraint(compiler)
        os.kill(fill_process._process.pid, signal.SIGSTOP)  # the answer held back
        try:
            sent = fill_process.send_fill([ConstrainedRow(constraint, 0, None)])
            first = callers.submit(sent.result)
            time.sleep(0.3)  # the first caller is reading the connection
            second = callers.submit(sent.result)
            time.sleep(0.3)
            assert not first.done() and not second.done(), "no caller returns before the answer comes"
        finally:
            os.kill(fill_process._process.pid, signal.SIGCONT)
        masks = first.result(timeout=30)
        assert second.result(timeout=30) is masks
        assert masks.shape[0] == 1 and masks.any(), "the row's first mask, filled there"
        assert constraint.error is None
    finally:
        callers.shutdown(wait=False, cancel_futures=True)
        fill_process.close()
        compiler.close()


def test_rows_filled_apart_fail_without_raising_when_the_fill_process_stalls(
        stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer, vocab_size: int, tmp_path: Path) -> None:
    """A slow grammar's rows are filled apart on a thread of their own; as in-process, a failure there
    fails those rows (EOS-only masks, their constraints' error) and raises nothing into the step."""
    fill_process = remote(stored_model_dir, ll_tokenizer, tokenizer, vocab_size, tmp_path)
    fill_process.answer_timeout_s = 2
    compiler = GrammarCompiler(ll_tokenizer)
    try:
        constraint = schema_constraint(compiler)
        first = fill_process.fill_apart([ConstrainedRow(constraint, 0, None)])  # the fill process holds it now
        token = allowed(first[0])[0]
        os.kill(fill_process._process.pid, signal.SIGSTOP)
        masks = fill_process.fill_apart([ConstrainedRow(constraint, 0, token)])
    finally:
        fill_process.close()
        compiler.close()
    assert constraint.error is not None and "did not answer within 2 s" in constraint.error
    assert allowed(masks[0]) == sorted(tokenizer.eos_token_ids)
