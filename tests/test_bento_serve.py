"""A Bento built with `bentoml build` and served with `bentoml serve <tag>` (not the source
folder) answers the OpenAI API: the built artefact, not just the checkout, is runnable."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from bento_server import REPO_ROOT, bentoml_serve


@pytest.fixture(scope="module")
def built_tag(bentoml_home: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLGTRT_")}
    env.update(BENTOML_HOME=str(bentoml_home), BENTOML_DO_NOT_TRACK="true")
    result = subprocess.run(["bentoml", "build", "--output", "tag"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result.stdout.strip().splitlines()[-1].removeprefix("__tag__:")


def test_served_bento_passes_a_smoke_test(built_tag: str, bentoml_home: Path, tmp_path: Path) -> None:
    with bentoml_serve(built_tag, bentoml_home, tmp_path / "serve.log") as bento:
        models = httpx.get(f"{bento.url}/v1/models", timeout=10).json()
        model = models["data"][0]["id"]
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
        response = httpx.post(f"{bento.url}/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Name the capital of France as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        })
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert set(json.loads(choice["message"]["content"])) == {"city"}
        assert "llgtrt:generation_tokens_total" in httpx.get(f"{bento.url}/metrics", timeout=10).text
        log = bento.log_tail()
    assert f'BentoServer from "{built_tag}"' in log  # the Bento in the store, not this checkout
