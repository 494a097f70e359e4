"""Start a real `bentoml serve` in a subprocess for tests that need their own server (a config of
their own, a Bento, or one they shut down); conftest's `server` fixture is the shared default one."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180
# The suite's servers compute in float32: its tests compare answers token for token across batch
# sizes and against what the float32 model says, where the CPU default (int4 weights, bfloat16
# activations) can flip a near-tie (docs/benchmarks/cpu.md). tests/test_quantized_weights.py tests
# that default; benchmarks serve it (suite_numerics=False).
SUITE_ENV = {"LLGTRT_DTYPE": "float32"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BentoServer:
    def __init__(self, process: subprocess.Popen, url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log

    def log_tail(self, chars: int = 8000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM to the server and its workers; SIGKILL past `timeout_s`. Returns the exit code."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


@contextlib.contextmanager
def bentoml_serve(target: str, bentoml_home: Path, log: Path, env: Mapping[str, str] = {},
                  args: Sequence[str] = (), suite_numerics: bool = True) -> Iterator[BentoServer]:
    """`bentoml serve <target> [args]` on a free loopback port, yielded once /readyz answers 200;
    suite_numerics: SUITE_ENV under `env`."""
    port = free_port()
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("LLGTRT_")}
    server_env.update(BENTOML_HOME=str(bentoml_home), BENTOML_DO_NOT_TRACK="true",
                      **(SUITE_ENV if suite_numerics else {}), **env)
    with log.open("w") as out:
        process = subprocess.Popen(["bentoml", "serve", target, "--host", "127.0.0.1", "--port", str(port), *args],
                                   cwd=REPO_ROOT, env=server_env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = BentoServer(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"bentoml serve exited with {process.returncode}:\n{server.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"bentoml serve not ready after {START_TIMEOUT_S} s:\n{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        server.stop()
