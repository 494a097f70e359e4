"""The JSON5 configuration: merge order, unknown keys, types, env overrides, --print-config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import json5
import pytest

from llgtrt_core.config import Config, ConfigError, load_config, merge, render

REPO_ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_no_files_and_no_env_give_the_defaults() -> None:
    config = load_config(env={})
    assert config == Config()
    assert config.model_tag == "smollm2-135m-instruct:latest" and not config.model_configured
    assert config.runtime.max_batch_size == 8 and config.server.api_key is None


def test_merge_recurses_into_objects_and_replaces_scalars_and_arrays() -> None:
    base = {"a": {"x": 1, "y": [1, 2], "z": {"deep": 1, "keep": 2}}, "b": 1}
    override = {"a": {"y": [3], "z": {"deep": 9}}, "b": {"now": "an object"}}
    assert merge(base, override) == {"a": {"x": 1, "y": [3], "z": {"deep": 9, "keep": 2}}, "b": {"now": "an object"}}


def test_files_merge_in_order_then_env_wins(tmp_path: Path) -> None:
    first = write(tmp_path / "a.json5", """{
        // JSON5: comments, unquoted keys, trailing commas
        runtime: {max_batch_size: 4, max_model_len: 1024},
        llguidance: {limits: {max_items_in_row: 100, step_max_items: 10}},
        tokenizer: {eos_token_ids: [1, 2]},
    }""")
    second = write(tmp_path / "b.json5", """{
        runtime: {max_batch_size: 16},
        llguidance: {limits: {max_items_in_row: 200}},
        tokenizer: {eos_token_ids: [7]},
    }""")
    env = {"LLGTRT_CONFIG": f"{first},{second}", "LLGTRT_MAX_MODEL_LEN": "512", "LLGTRT_API_KEY": "k"}
    config = load_config(env=env)
    assert config.runtime.max_batch_size == 16  # the later file's scalar
    assert config.runtime.max_model_len == 512  # the environment over both files
    assert config.llguidance.limits.max_items_in_row == 200
    assert config.llguidance.limits.step_max_items == 10  # kept from the first file: objects merge
    assert config.tokenizer.eos_token_ids == [7]  # arrays replace
    assert config.server.api_key == "k"
    # Colons separate paths too; an empty LLGTRT_* variable changes nothing.
    colon = load_config(env={"LLGTRT_CONFIG": f"{second}:{first}", "LLGTRT_MAX_BATCH_SIZE": ""})
    assert colon.runtime.max_batch_size == 4


@pytest.mark.parametrize(("text", "named"), [
    ("{runtime: {max_batch_sise: 4}}", "runtime.max_batch_sise"),
    ("{llguidance: {limits: {max_items: 4}}}", "llguidance.limits.max_items"),
    ("{sever: {}}", "sever"),
])
def test_an_unknown_key_is_an_error_naming_it(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config([write(tmp_path / "c.json5", text)], env={})


@pytest.mark.parametrize("text", [
    '{runtime: {max_batch_size: "8"}}',
    "{runtime: {max_batch_size: true}}",
    "{runtime: {max_batch_size: -1}}",
    "{server: {api_key: 3}}",
    "{tokenizer: {eos_token_ids: [1, 'x']}}",
    "{runtime: 4}",
    "[1, 2]",
    "{runtime: {",
])
def test_a_bad_value_or_file_is_an_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        load_config([write(tmp_path / "c.json5", text)], env={})


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.json5"):
        load_config(env={"LLGTRT_CONFIG": str(tmp_path / "missing.json5")})


def test_ints_are_accepted_for_floats(tmp_path: Path) -> None:
    config = load_config([write(tmp_path / "c.json5", "{runtime: {kv_cache_free_gpu_mem_fraction: 1}}")], env={})
    assert config.runtime.kv_cache_free_gpu_mem_fraction == 1.0


def _uncommented(text: str) -> str:
    """The printed config with every commented-out option turned on (doc comments dropped)."""
    lines = []
    for line in text.splitlines():
        body = line.strip()
        if body.startswith('// "'):
            lines.append(body[3:])
        elif not body.startswith("//"):
            lines.append(line)
    return "\n".join(lines)


LLGUIDANCE_SECTIONS = {"limits": {}, "loop_guard": {}, "number_bounds": {}}  # printed even when all at default


def test_print_config_comments_every_option_and_comments_out_defaults() -> None:
    result = subprocess.run([sys.executable, "-m", "llgtrt_core.config", "--print-config"], cwd=REPO_ROOT,
                            env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert json5.loads(text) == {s: LLGUIDANCE_SECTIONS if s == "llguidance" else {} for s in
                                 ("model", "runtime", "tokenizer", "llguidance", "reasoning", "server")}  # all at default
    assert Config.from_mapping(json5.loads(_uncommented(text))) == Config()  # and those defaults are ours
    lines = text.splitlines()
    options = [i for i, line in enumerate(lines) if line.strip().startswith(('"', '// "'))]
    assert len(options) > 30
    assert all(lines[i - 1].strip().startswith("//") and not lines[i - 1].strip().startswith('// "')
               for i in options)  # a doc comment right above every option and section


def test_print_config_shows_what_was_set_uncommented(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json5", "{server: {max_queued_requests: 3}, llguidance: {log_level: 1}}")
    text = render(load_config([path], env={}))
    assert '\n    "max_queued_requests": 3,' in text and '// "max_queued_requests"' not in text
    assert json5.loads(text) == {"model": {}, "runtime": {}, "tokenizer": {}, "reasoning": {},
                                 "server": {"max_queued_requests": 3},
                                 "llguidance": {**LLGUIDANCE_SECTIONS, "log_level": 1}}


def test_cli_reports_config_errors_with_the_key() -> None:
    result = subprocess.run([sys.executable, "-m", "llgtrt_core.config", "--print-config"], cwd=REPO_ROOT,
                            env={"PATH": "/usr/bin:/bin", "LLGTRT_CONFIG": "/dev/null"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "/dev/null" in result.stderr


def test_docs_list_the_current_options_and_defaults() -> None:
    docs = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert f"```json5\n{render(Config())}```" in docs, "regenerate with python -m llgtrt_core.config --print-config"


def test_tool_format_comes_from_a_file_or_the_env_and_must_be_known(tmp_path: Path) -> None:
    assert load_config(env={}).tokenizer.tool_format is None  # detected from the chat template
    assert load_config(env={"LLGTRT_TOOL_FORMAT": "mistral"}).tokenizer.tool_format == "mistral"
    with pytest.raises(ConfigError, match=r"tokenizer\.tool_format.*'chatml'"):
        load_config([write(tmp_path / "c.json5", "{tokenizer: {tool_format: 'chatml'}}")], env={})


def test_a_bad_integer_variable_is_an_error() -> None:
    with pytest.raises(ConfigError, match="LLGTRT_MAX_BATCH_SIZE"):
        load_config(env={"LLGTRT_MAX_BATCH_SIZE": "eight"})


def test_mask_threads_come_from_the_env_and_must_be_at_least_one() -> None:
    assert load_config(env={}).llguidance.mask_threads is None  # llguidance's default pool
    assert load_config(env={"LLGTRT_MASK_THREADS": "6"}).llguidance.mask_threads == 6
    with pytest.raises(ConfigError, match=r"llguidance\.mask_threads.*at least 1"):
        load_config(env={"LLGTRT_MASK_THREADS": "0"})


def test_compile_threads_must_be_at_least_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"llguidance\.compile_threads.*at least 1"):
        load_config([write(tmp_path / "c.json5", "{llguidance: {compile_threads: 0}}")], env={})


def test_a_boolean_variable_takes_true_or_false() -> None:
    assert load_config(env={}).runtime.cpu_compile is None
    assert load_config(env={"LLGTRT_CPU_COMPILE": "false"}).runtime.cpu_compile is False
    assert load_config(env={"LLGTRT_CPU_COMPILE": "True"}).runtime.cpu_compile is True
    with pytest.raises(ConfigError, match="LLGTRT_CPU_COMPILE"):
        load_config(env={"LLGTRT_CPU_COMPILE": "0"})


def test_the_service_refuses_to_start_on_an_unknown_key(tmp_path: Path) -> None:
    config = write(tmp_path / "c.json5", "{server: {max_concurent_requests: 4}}")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "BENTOML_HOME": str(tmp_path / "bentoml"),
           "BENTOML_DO_NOT_TRACK": "true", "LLGTRT_CONFIG": str(config)}
    result = subprocess.run(["bentoml", "serve", ".", "--port", "0"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "server.max_concurent_requests" in result.stdout + result.stderr
