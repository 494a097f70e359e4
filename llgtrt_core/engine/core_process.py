"""The engine process: the embedded engine, its grammar compiler and mask post-processor, apart from
the serving processes (docs/architecture.md says why).

Started by `EngineCoreClient` as `python -m llgtrt_core.engine.core_process FD`, FD one end of a
socket pair to the API worker that started it (the owner). With several API workers
(`server.api_workers`) it also listens on a Unix socket (CoreSpec.listen_path) where the other
workers connect. Each connection has a reader thread (the owner's: the main thread); grammars
compile on the compiler's threads; the engine thread runs the steps and sends each step's deltas
to each worker in one message. A worker that goes away has its requests aborted. The process exits
when the owner asks or goes away (end of file), after the other workers' requests have ended;
signals to its process group leave it to the owner to stop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Optional

from llgtrt_core.constraints.fill_process import RemoteMaskPostProcessor
from llgtrt_core.constraints.grammar import GrammarCompiler, GrammarConstraint, build_ll_tokenizer
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.engine.core_protocol import CoreSpec, delta_row
from llgtrt_core.engine.interface import EngineError, GenerationRequest, SamplingParams, TokenDelta
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.heap import collect_young_less_often, freeze_loaded_objects
from llgtrt_core.kernels import cuda_kernel_available
from llgtrt_core.tokenizer import Tokenizer

logger = logging.getLogger("llgtrt.engine")

_DRAIN_TIMEOUT_S = 60  # the owner stops: how long the other workers' requests may still run


@dataclass(eq=False)
class Worker:
    """One API worker's connection; `index` 0 is the owner."""

    index: int
    conn: Connection
    _send_lock: threading.Lock = field(default_factory=threading.Lock)  # reader, compile and engine threads send

    def send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except OSError:  # it went away; its reader thread aborts its requests
                pass


# A request in the engine: the worker it came from and the id that worker gave it. Two workers may
# use the same id, so the engine's id is both (`engine_id`).
Route = tuple[Worker, str]


def engine_id(worker: Worker, request_id: str) -> str:
    return f"{worker.index}/{request_id}"


class EngineCore:
    def __init__(self, owner: Connection, spec: CoreSpec) -> None:
        self.owner = Worker(0, owner)
        self.spec = spec
        tokenizer = Tokenizer(spec.model_dir)
        ll_tokenizer = build_ll_tokenizer(tokenizer.hf, spec.vocab_size, list(spec.eos_token_ids))
        self.grammars = GrammarCompiler.from_config(ll_tokenizer, spec.llguidance)
        config = spec.engine_config
        self.fill_process: Optional[RemoteMaskPostProcessor] = None
        post_processor: MaskPostProcessor
        fill_process = spec.llguidance.fill_process
        if fill_process is None:  # the default: where the engine runs on CUDA
            fill_process = config.resolve_device().type == "cuda"  # type: ignore[attr-defined]
        if fill_process:
            self._fill_folder = tempfile.TemporaryDirectory(prefix="llgtrt-fill-")  # private to the user
            post_processor = self.fill_process = RemoteMaskPostProcessor.start(
                spec.model_dir, ll_tokenizer, spec.vocab_size, spec.eos_token_ids, spec.llguidance,
                config.max_batch_size, os.path.join(self._fill_folder.name, "fill.sock"))  # type: ignore[attr-defined]
            self.grammars.on_miss = self.fill_process.precompile  # both compile a new grammar at once
        else:
            post_processor = MaskPostProcessor(ll_tokenizer, num_threads=spec.llguidance.mask_threads,
                                               max_batch_size=config.max_batch_size)  # type: ignore[attr-defined]
        cuda_kernel_available()  # build (or load) the CUDA mask kernel now, not on the first constrained step
        self.engine = TorchEngine(Path(spec.model_dir), config, post_processor, deliver=self._send_deltas)  # type: ignore[arg-type]
        # Requests whose grammar is compiling (an abort drops them when it is done), the requests in
        # the engine (until their last delta), and the constraint of every constrained one (its error
        # makes a failed row a grammar error); keyed by engine_id.
        self._compiling: set[str] = set()
        self._routes: dict[str, Route] = {}
        self._constraints: dict[str, GrammarConstraint] = {}
        self._admission_lock = threading.Lock()
        self._workers: list[Worker] = [self.owner]
        self._worker_numbers = itertools.count(1)

    def run(self) -> None:
        try:
            asyncio.run(self.engine.start())
        except Exception as e:
            logger.exception("the engine could not start")
            self.owner.send(("failed", f"{type(e).__name__}: {e}"))
            return
        freeze_loaded_objects()
        collect_young_less_often()
        ready = ("ready", self.engine.vocab_size, self.engine.max_model_len)
        self.owner.send(ready)
        listener = self._listen(ready) if self.spec.listen_path else None
        try:
            if self._serve(self.owner):  # the owner said stop (gone: a new owner may soon need the device)
                self._drain_others()
        finally:
            if listener is not None:
                listener.close()
            asyncio.run(self.engine.shutdown())
            self.grammars.close()
            if self.fill_process is not None:
                self.fill_process.close()

    # ---- workers ---------------------------------------------------------------------

    def _listen(self, ready: tuple) -> Listener:
        """The other API workers connect here; each is told `ready` and served on a thread."""
        path = self.spec.listen_path
        if os.path.exists(path):  # left by an engine process of this server that died
            os.unlink(path)
        listener = Listener(path, family="AF_UNIX")

        def accept() -> None:
            while True:
                try:
                    conn = listener.accept()
                except OSError:  # closed at exit
                    return
                worker = Worker(next(self._worker_numbers), conn)
                with self._admission_lock:
                    self._workers.append(worker)
                worker.send(ready)
                threading.Thread(target=self._serve_other, args=(worker,), name=f"worker-{worker.index}",
                                 daemon=True).start()

        threading.Thread(target=accept, name="accept-workers", daemon=True).start()
        return listener

    def _serve(self, worker: Worker) -> bool:
        """Handle the worker's messages until it goes away (False) or says stop (True)."""
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                return False
            if message[0] == "stop":
                return True
            self._handle(worker, message)

    def _serve_other(self, worker: Worker) -> None:
        self._serve(worker)
        worker.conn.close()
        with self._admission_lock:  # its requests still compiling are dropped when they are done
            self._workers.remove(worker)
            self._compiling.difference_update([rid for rid in list(self._compiling)
                                               if rid.startswith(f"{worker.index}/")])
            in_engine = [rid for rid, (w, _) in list(self._routes.items()) if w is worker]
        for rid in in_engine:
            self.engine.abort(rid)

    def _drain_others(self) -> None:
        """The owner stops: the other workers' requests (which they are draining too) may end first."""
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while time.monotonic() < deadline and (self._compiling or self._routes):
            time.sleep(0.05)

    # ---- requests --------------------------------------------------------------------

    def _handle(self, worker: Worker, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, sampling, grammar = message
            if grammar is None:
                self._admit(worker, request_id, prompt, sampling, None)
                return
            self._compiling.add(engine_id(worker, request_id))
            future = self.grammars.compile_future(grammar)
            future.add_done_callback(lambda done: self._admit(worker, request_id, prompt, sampling, done.result()))
        elif kind == "abort":
            rid = engine_id(worker, message[1])
            with self._admission_lock:
                compiling = rid in self._compiling
                self._compiling.discard(rid)
            if not compiling:
                self.engine.abort(rid)
        elif kind == "precompile":
            self.grammars.compile_future(message[1])
        elif kind == "stats":
            worker.send(("stats", message[1], self.engine.step_stats()))

    def _admit(self, worker: Worker, request_id: str, prompt: list[int], sampling: SamplingParams,
               compiled: object) -> None:
        """Queue a request whose grammar (if any) compiled; a reader thread or a compile thread."""
        rid = engine_id(worker, request_id)
        constraint: Optional[GrammarConstraint] = None
        if compiled is not None:
            try:
                constraint = self.grammars.new_constraint(GrammarCompiler.checked(compiled, ""),
                                                          loop_guard=sampling.loop_guard)
            except Exception as e:  # GrammarRequestError: the serving process names the field
                self._compiling.discard(rid)
                worker.send(("rejected", request_id, "grammar", getattr(e, "message", str(e))))
                return
        request = GenerationRequest(rid, prompt, sampling, constraint)
        try:
            self.engine.check(request)
        except EngineError as e:
            self._compiling.discard(rid)
            worker.send(("rejected", request_id, "engine", str(e)))
            return
        with self._admission_lock:  # an abort is either before this (dropped here) or after (reaches the engine)
            if compiled is not None:
                if rid not in self._compiling:  # aborted while it compiled
                    return
                self._compiling.discard(rid)
            if worker not in self._workers:  # it went away meanwhile
                return
            worker.send(("accepted", request_id))  # before submit: no delta of it can overtake this
            if constraint is not None:
                self._constraints[rid] = constraint
            self._routes[rid] = (worker, request_id)
            self.engine.submit(request, rid)

    def _send_deltas(self, outbox: list[tuple[object, TokenDelta]]) -> None:
        """The engine thread's delivery: one message for the step to each worker with deltas in it."""
        rows: dict[Worker, list] = {}
        for rid, delta in outbox:
            grammar_error = False
            if delta.finish_reason is not None:
                constraint = self._constraints.pop(rid, None)  # type: ignore[arg-type]
                grammar_error = constraint is not None and constraint.error is not None
                if constraint is not None and self.fill_process is not None:
                    self.fill_process.release(constraint)
                worker, request_id = self._routes.pop(rid)  # type: ignore[arg-type]
            else:
                worker, request_id = self._routes[rid]  # type: ignore[index]
            rows.setdefault(worker, []).append(delta_row(request_id, delta, grammar_error))
        for worker, worker_rows in rows.items():
            worker.send(("deltas", worker_rows))


def main() -> None:
    # A terminal's Ctrl+C and a SIGTERM to the server's process group reach this process too: the
    # owner stops it itself once its streams are drained ("stop", or end of file).
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
