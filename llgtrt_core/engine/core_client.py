"""The `Engine` an API worker uses for the embedded engine: a client of the engine process.

The embedded engine, its grammar compiler and mask post-processor run in their own process
(core_process.py), so the API workers' event loops (HTTP, SSE, templates, tokenizing,
detokenizing) and the engine's step loop never wait for each other's GIL. A request goes over as
its token ids, sampling parameters and grammar text, which only the engine process compiles
(from its cache) and refuses (a 400 naming the request field); a tools grammar the API worker
compiles too, to name a failing tool, and a first sight starts both compiles at once. A reader
thread takes each step's message off the socket and hands it to the event loop in one wake-up.

One API worker (the owner) starts the engine process; with several (`server.api_workers`), the
others join it through its Unix socket. When the engine process dies, its requests end with an
error, new ones get 503, and the owner starts another (after a pause that grows while processes die
young); the others keep trying to join it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from llgtrt_core import metrics
from llgtrt_core.constraints.errors import GrammarRequestError
from llgtrt_core.engine.core_protocol import CoreSpec, DeltaRow, row_delta
from llgtrt_core.engine.interface import (Engine, EngineError, EngineUnavailable, GenerationRequest, TokenDelta,
                                          next_delta)
from llgtrt_core.server_files import server_file_path

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 60
_JOIN_RETRY_S = 0.5
_EXIT_WAIT_S = 10  # a dead engine process's socket closes as it exits: past this, it is killed
# The pause before starting another engine process after the n-th death in a row; a process that
# served _STABLE_S or more resets the count (a crash loop must not hold the device busy loading).
_RESTART_DELAYS_S = (1, 2, 4, 8, 16, 32, 60)
_STABLE_S = 60
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds llgtrt_core


@dataclass
class _Stream:
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)  # "accepted", a rejection, then TokenDeltas
    constraint: Any = None  # the serving process's GrammarConstraint: marked failed on a grammar error


@dataclass(frozen=True)
class _Rejected:
    kind: str
    message: str


_ACCEPTED = object()


class EngineCoreClient(Engine):
    def __init__(self, spec: CoreSpec, owner: bool = True) -> None:
        """owner: start the engine process; otherwise join the one at spec.listen_path."""
        self.spec = spec
        self.owner = owner
        self.vocab_size = spec.vocab_size
        self.max_model_len = 0  # the engine process tells
        self._process: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._streams: dict[str, _Stream] = {}
        self._stats: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._lost: Optional[str] = None  # why the engine process is gone
        self._closing = False  # shutdown asked for: its end is no loss
        self._ready_at = 0.0  # when the engine process in use said ready
        self._deaths_in_a_row = 0  # engine processes that died young, one after the other (owner)

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.owner:
            self._conn, ready = await asyncio.to_thread(self._join)
            self._ready(ready)
            return
        _, self._conn, ready = await asyncio.to_thread(self._spawn)
        self._ready(ready)

    def _spawn(self) -> tuple[subprocess.Popen, Connection, tuple]:
        """Start an engine process and wait for its first message: "ready", or why it failed."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen([sys.executable, "-m", "llgtrt_core.engine.core_process", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env)
        self._process = process  # shutdown waits for it, also while it loads
        theirs.close()
        conn = Connection(ours.detach())
        conn.send(self.spec)
        while not conn.poll(1.0):
            if process.poll() is not None:
                return process, conn, ("failed", f"exit code {process.returncode}")
        return process, conn, conn.recv()

    def _ready(self, ready: tuple) -> None:
        if ready[0] != "ready":
            raise EngineError(f"the engine process failed to start: {ready[1]}")
        _, self.vocab_size, self.max_model_len = ready
        self._ready_at = time.monotonic()
        if self._process is not None:
            logger.info("engine process %d ready", self._process.pid)
        threading.Thread(target=self._read, name="engine-core-reader", daemon=True).start()

    def _join(self) -> tuple[Connection, tuple]:
        """Connect to the owner's engine process once it listens (it loads the model meanwhile)."""
        while not self._closing:
            try:
                conn = Client(self.spec.listen_path, family="AF_UNIX")
                return conn, conn.recv()
            except (OSError, EOFError):
                time.sleep(_JOIN_RETRY_S)
        raise EngineUnavailable("shutting down")

    async def shutdown(self) -> None:
        self._closing = True
        if not self.owner:
            if self._conn is not None and self._lost is None:
                # The engine process aborts what is left of ours; the reader, woken by the end of
                # file, closes the connection.
                with socket.socket(fileno=os.dup(self._conn.fileno())) as ours:
                    ours.shutdown(socket.SHUT_RDWR)
            return
        if self._process is None:
            return
        if self._lost is None:
            self._send(("stop",))
        try:
            await asyncio.to_thread(self._process.wait, _STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
        _forget_metrics(self._process.pid)
        self._process = None

    # ---- requests --------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._streams)

    @property
    def failure(self) -> Optional[str]:
        return self._lost

    def abort(self, request_id: str) -> None:
        if self._lost is None:
            self._send(("abort", request_id))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Yields an empty delta once the engine process took the request (the serving layer may then
        answer 200), then its deltas; raises EngineError when it refused it."""
        if self._lost is not None:
            raise EngineUnavailable(self._lost)
        rid = request.request_id
        stream = self._streams[rid] = _Stream(constraint=request.constraint)
        grammar = getattr(request.constraint, "grammar", None)
        self._send(("add", rid, request.prompt_token_ids, request.sampling, grammar))
        finished = False
        try:
            first = await stream.deltas.get()
            if isinstance(first, _Rejected):
                finished = True
                if first.kind == "grammar":  # the engine process compiles the grammars: a 400 naming the field
                    raise GrammarRequestError(getattr(request.constraint, "param", None) or "response_format",
                                              first.message)
                raise EngineError(first.message)
            if isinstance(first, TokenDelta):  # the engine process went away meanwhile
                finished = True
                yield first
                return
            yield TokenDelta()
            while not finished:
                delta = await next_delta(stream.deltas)
                finished = delta.finish_reason is not None
                yield delta
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the consumer went away: free the slot
                self.abort(rid)

    async def stats(self) -> dict[str, object]:
        if self._lost is not None:
            return {}
        token = next(self._tokens)
        waiter = self._stats[token] = asyncio.get_running_loop().create_future()
        self._send(("stats", token))
        try:
            return await asyncio.wait_for(waiter, 10)
        finally:
            self._stats.pop(token, None)

    def precompile(self, grammar: str) -> None:
        """A grammar the serving process started compiling: the engine process compiles it meanwhile."""
        if self._lost is None and self._conn is not None:
            self._send(("precompile", grammar))

    # ---- the socket ------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as e:  # the engine process died; the reader thread reports it
            logger.error("sending to the engine process failed: %s", e)

    def _read(self) -> None:
        """Reader thread: each message to the event loop in one wake-up."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if self._closing:
                    self._conn.close()
                    return
                if self.owner:
                    code = _reap(self._process)
                    self._loop.call_soon_threadsafe(self._engine_lost, f"the engine process exited (code {code})")
                    self._restart()
                else:
                    self._loop.call_soon_threadsafe(self._engine_lost, "the engine process exited")
                    self._rejoin()
                return
            self._loop.call_soon_threadsafe(self._on_message, message)

    def _restart(self) -> None:
        """The owner's reader thread, its engine process gone: start another, after a pause that grows
        while they die young, until one is ready or the server shuts down."""
        young = time.monotonic() - self._ready_at < _STABLE_S
        self._deaths_in_a_row = self._deaths_in_a_row + 1 if young else 1
        while not self._closing:
            delay = _RESTART_DELAYS_S[min(self._deaths_in_a_row, len(_RESTART_DELAYS_S)) - 1]
            logger.warning("starting another engine process in %d s", delay)
            time.sleep(delay)
            if self._closing:
                return
            metrics.engine_restarts.inc()
            process, conn, ready = self._spawn()
            if ready[0] == "ready":
                self._loop.call_soon_threadsafe(self._engine_back, conn, ready)
                return
            logger.error("the engine process failed to start again: %s", ready[1])
            conn.close()
            _reap(process)
            self._deaths_in_a_row += 1

    def _rejoin(self) -> None:
        """A joining worker whose engine process went away: join the next one (a restarted owner's)."""
        time.sleep(_JOIN_RETRY_S)  # let the event loop fail the streams of the lost one first
        try:
            conn, ready = self._join()
        except EngineUnavailable:  # shut down meanwhile
            return
        self._loop.call_soon_threadsafe(self._engine_back, conn, ready)

    def _engine_back(self, conn: Connection, ready: tuple) -> None:
        if self._closing:  # an owner's new engine process ends at the end of file, as after a stop
            conn.close()
            return
        logger.info("%s the engine process again", "started" if self.owner else "joined")
        self._conn = conn
        self._lost = None
        self._ready(ready)

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "deltas":
            rows: list[DeltaRow] = message[1]
            for row in rows:
                stream = self._streams.get(row[0])
                if stream is None:  # aborted meanwhile
                    continue
                if row[7] and stream.constraint is not None:  # the grammar failed mid-generation
                    stream.constraint.fail(row[3] or "grammar error")
                stream.deltas.put_nowait(row_delta(row))
        elif kind == "accepted":
            stream = self._streams.get(message[1])
            if stream is not None:
                stream.deltas.put_nowait(_ACCEPTED)
        elif kind == "rejected":
            stream = self._streams.get(message[1])
            if stream is not None:
                stream.deltas.put_nowait(_Rejected(message[2], message[3]))
        elif kind == "stats":
            waiter = self._stats.get(message[1])
            if waiter is not None and not waiter.done():
                waiter.set_result(message[2])

    def _engine_lost(self, why: str) -> None:
        if self._lost is not None or self._closing:
            return
        logger.error("%s; failing its %d requests", why, len(self._streams))
        self._lost = why
        for stream in self._streams.values():
            stream.deltas.put_nowait(TokenDelta(finish_reason="error", error=why))
        for waiter in self._stats.values():
            if not waiter.done():
                waiter.set_exception(EngineUnavailable(why))


def api_worker_index() -> int:
    """This API worker's number among the server's, from 1 (BentoML reuses a dead worker's number)."""
    import bentoml

    return bentoml.server_context.worker_index or 1


def engine_socket_path() -> str:
    """The engine process's Unix socket, the same for every API worker of one `bentoml serve`."""
    return server_file_path("engine", ".sock")


def _reap(process: subprocess.Popen) -> int:
    """A dead engine process's exit code, once it is gone (killed if it lingers)."""
    try:
        code = process.wait(_EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    _forget_metrics(process.pid)
    return code


def _forget_metrics(pid: int) -> None:
    """Drop the engine process's live gauges (running, waiting, KV usage) from BentoML's /metrics,
    which in multiprocess mode reads every process's files until told that one is gone."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
