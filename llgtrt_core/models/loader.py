"""Build a model from a Hugging Face style directory: config.json + *.safetensors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from llgtrt_core.models.llama import LlamaForCausalLM, ModelConfig

logger = logging.getLogger(__name__)


def load_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def load_model(model_dir: Path, max_positions: int, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    config = load_config(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty off "meta" makes new Parameters, untying them
        model.lm_head.weight = model.model.embed_tokens.weight
    parameters = dict(model.named_parameters())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name not in parameters:
                    continue  # e.g. rotary inv_freq buffers some exporters save
                parameters[name].data.copy_(shard.get_tensor(name))
                loaded.add(name)
    missing = set(parameters) - loaded
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    logger.info("loaded %s (%d tensors) on %s as %s", config.architecture, len(loaded), device, dtype)
    model = model.to(dtype=dtype).eval()
    model.reset_rope_tables()  # to_empty left them uninitialized, and they must stay float32
    return model
