"""`bentoml build` of this repository, offline, into conftest's isolated BENTOML_HOME.

Offline works because `uv` is installed and bentofile.yaml turns package locking off.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def bentoml_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # LLGTRT_* unset: the service must name the default model whatever the developer's shell says.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLGTRT_")}
    env.update(BENTOML_HOME=str(home), BENTOML_DO_NOT_TRACK="true")
    return subprocess.run(["bentoml", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def bento_tag(bentoml_home: Path) -> str:
    result = bentoml_cli(bentoml_home, "build", "--output", "tag")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    # `-o tag` prints `__tag__:<name>:<version>`
    return result.stdout.strip().splitlines()[-1].removeprefix("__tag__:")


@pytest.fixture(scope="module")
def bento_info(bentoml_home: Path, bento_tag: str) -> dict:
    result = bentoml_cli(bentoml_home, "get", bento_tag, "--output", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_bento_serves_the_llm_service_and_names_the_default_model(
    bento_info: dict, stored_model_dir: Path
) -> None:
    assert bento_info["service"] == "service:LLM"
    models = [m["tag"] for service in bento_info["services"] for m in service["models"]]
    assert models == [f"{DEFAULT_MODEL_NAME}:{stored_model_dir.name}"]  # the version packed in this store
    assert "llguidance" in bento_info["image"]["python_requirements"]  # requirements.txt made it into the image


def test_exported_bento_bundles_model_and_sources(bentoml_home: Path, bento_tag: str, tmp_path: Path) -> None:
    archive = tmp_path / "llgtrt.tar"  # plain tar: the default .bento compresses 540 MB for minutes
    result = bentoml_cli(bentoml_home, "export", bento_tag, str(archive))
    assert result.returncode == 0, result.stderr
    with tarfile.open(archive) as tar:
        members = {name.removeprefix("./") for name in tar.getnames()}

    model_files = {name.rsplit("/", 1)[-1] for name in members if name.startswith(f"models/{DEFAULT_MODEL_NAME}/")}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "model.yaml"} <= model_files

    sources = {name.removeprefix("src/") for name in members if name.startswith("src/")}
    assert {"service.py", "requirements.txt", "README.md", "llgtrt_core/model_store.py"} <= sources
    assert "llgtrt_core/engine/interface.py" in sources
    assert not any(name.startswith(("tests", "bench", "docs")) or "__pycache__" in name for name in sources)
