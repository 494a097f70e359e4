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


def _empty_model(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device
                 ) -> LlamaForCausalLM:
    """Uninitialized weights in `dtype` on `device`. The cast happens on "meta", where it is free:
    made in float32 on the GPU and cast there, the freed float32 copy stayed in torch's caching
    allocator and the KV cache, sized from the memory free after loading, lost that much."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions).to(dtype)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty off "meta" makes new Parameters, untying them
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def random_model(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> LlamaForCausalLM:
    """Random weights of a real shape, made on the device (benchmarks and tests need no checkpoint).

    Matrices draw from N(0, 1/fan_in) and embeddings from N(0, 1), so activations and logits keep
    unit scale through the layers: greedy picks have clear margins, unlike near-uniform tiny weights.
    """
    model = _empty_model(config, max_positions, dtype, device)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                std = 1.0 if parameter.ndim == 1 or "embed_tokens" in name else parameter.shape[-1] ** -0.5
                parameter.normal_(0.0, std, generator=generator)
    model.eval()
    model.reset_rope_tables()
    return model


def load_model(model_dir: Path, max_positions: int, dtype: torch.dtype, device: torch.device,
               weights: str = "dense") -> LlamaForCausalLM:
    """weights: "dense" (in `dtype`), or the matmuls on weight-only "int8", "int4" or "auto"
    (`LlamaForCausalLM.quantize_weights`), quantized from the checkpoint's values as loaded in float32."""
    config = load_config(model_dir)
    quantized = weights != "dense"
    model = _empty_model(config, max_positions, torch.float32 if quantized else dtype, device)
    parameters = model.checkpoint_tensors()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name not in parameters:
                    continue  # e.g. rotary inv_freq buffers some exporters save
                parameters[name].copy_(shard.get_tensor(name))
                loaded.add(name)
    missing = set(parameters) - loaded
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    model.eval()
    if quantized:
        weights = model.quantize_weights(weights, dtype)
    else:
        model.reset_rope_tables()  # to_empty left them uninitialized, and they must stay float32
    logger.info("loaded %s (%d tensors) on %s as %s, %s weights", config.architecture, len(loaded), device, dtype,
                weights)
    return model
