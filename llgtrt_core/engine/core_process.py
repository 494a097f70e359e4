"""The engine process: the embedded engine, its grammar compiler and mask post-processor, apart from
the serving process (docs/architecture.md says why).

Started by `EngineCoreClient` as `python -m llgtrt_core.engine.core_process FD`, FD one end of a
socket pair. Its main thread reads messages (core_protocol.py) and hands them on; grammars compile
on the compiler's threads; the engine thread runs the steps and sends each step's deltas in one
message. It exits when asked to, or when the serving process goes away (end of file); signals
to its process group leave it to the serving process to stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional

from llgtrt_core.constraints.grammar import GrammarCompiler, GrammarConstraint, build_ll_tokenizer
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.engine.core_protocol import CoreSpec, delta_row
from llgtrt_core.engine.interface import EngineError, GenerationRequest, SamplingParams, TokenDelta
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.kernels import cuda_kernel_available
from llgtrt_core.tokenizer import Tokenizer

logger = logging.getLogger("llgtrt.engine")


class EngineCore:
    def __init__(self, conn: Connection, spec: CoreSpec) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()  # the main thread, compile threads and the engine thread send
        tokenizer = Tokenizer(spec.model_dir)
        ll_tokenizer = build_ll_tokenizer(tokenizer.hf, spec.vocab_size, list(spec.eos_token_ids))
        self.grammars = GrammarCompiler.from_config(ll_tokenizer, spec.llguidance)
        config = spec.engine_config
        post_processor = MaskPostProcessor(ll_tokenizer, max_batch_size=config.max_batch_size)  # type: ignore[attr-defined]
        cuda_kernel_available()  # build (or load) the CUDA mask kernel now, not on the first constrained step
        self.engine = TorchEngine(Path(spec.model_dir), config, post_processor, deliver=self._send_deltas)  # type: ignore[arg-type]
        # Requests whose grammar is compiling (an abort drops them when it is done), and the constraint
        # of every constrained request in the engine (its error makes a failed row a grammar error).
        self._compiling: set[str] = set()
        self._constraints: dict[str, GrammarConstraint] = {}
        self._admission_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def run(self) -> None:
        try:
            asyncio.run(self.engine.start())
        except Exception as e:
            logger.exception("the engine could not start")
            self.send(("failed", f"{type(e).__name__}: {e}"))
            return
        self.send(("ready", self.engine.vocab_size, self.engine.max_model_len))
        try:
            while True:
                try:
                    message = self.conn.recv()
                except EOFError:  # the serving process is gone
                    break
                if message[0] == "stop":
                    break
                self._handle(message)
        finally:
            asyncio.run(self.engine.shutdown())
            self.grammars.close()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, sampling, grammar = message
            if grammar is None:
                self._admit(request_id, prompt, sampling, None)
                return
            self._compiling.add(request_id)
            future = self.grammars.compile_future(grammar)
            future.add_done_callback(lambda done: self._admit(request_id, prompt, sampling, done.result()))
        elif kind == "abort":
            request_id = message[1]
            with self._admission_lock:
                compiling = request_id in self._compiling
                self._compiling.discard(request_id)
            if not compiling:
                self.engine.abort(request_id)
        elif kind == "precompile":
            self.grammars.compile_future(message[1])
        elif kind == "stats":
            self.send(("stats", message[1], self.engine.step_stats()))

    def _admit(self, request_id: str, prompt: list[int], sampling: SamplingParams, compiled: object) -> None:
        """Queue a request whose grammar (if any) compiled; the main thread or a compile thread."""
        constraint: Optional[GrammarConstraint] = None
        if compiled is not None:
            try:
                constraint = self.grammars.new_constraint(GrammarCompiler.checked(compiled, ""),
                                                          loop_guard=sampling.loop_guard)
            except Exception as e:  # GrammarRequestError: the serving process names the field
                self._compiling.discard(request_id)
                self.send(("rejected", request_id, "grammar", getattr(e, "message", str(e))))
                return
        request = GenerationRequest(request_id, prompt, sampling, constraint)
        try:
            self.engine.check(request)
        except EngineError as e:
            self._compiling.discard(request_id)
            self.send(("rejected", request_id, "engine", str(e)))
            return
        with self._admission_lock:  # an abort is either before this (dropped here) or after (reaches the engine)
            if compiled is not None:
                if request_id not in self._compiling:  # aborted while it compiled
                    return
                self._compiling.discard(request_id)
            self.send(("accepted", request_id))  # before submit: no delta of it can overtake this
            if constraint is not None:
                self._constraints[request_id] = constraint
            self.engine.submit(request, request_id)

    def _send_deltas(self, outbox: list[tuple[object, TokenDelta]]) -> None:
        """The engine thread's delivery: one message for the step."""
        rows = []
        for request_id, delta in outbox:
            grammar_error = False
            if delta.finish_reason is not None:
                constraint = self._constraints.pop(request_id, None)  # type: ignore[arg-type]
                grammar_error = constraint is not None and constraint.error is not None
            rows.append(delta_row(request_id, delta, grammar_error))  # type: ignore[arg-type]
        self.send(("deltas", rows))


def main() -> None:
    # A terminal's Ctrl+C and a SIGTERM to the server's process group reach this process too: the
    # serving process stops it itself once its streams are drained ("stop", or end of file).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    conn = Connection(int(sys.argv[1]))
    spec: CoreSpec = conn.recv()
    try:
        core = EngineCore(conn, spec)
    except Exception as e:
        logger.exception("the engine process could not start")
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    core.run()


if __name__ == "__main__":
    main()
