"""Store a random-weight Llama-3-8B-shaped model in a BentoML model store, ready for `bentoml serve .`.

The serving benchmarks (http_load.py, constrained_tbt.py) need a real server on a real-size model,
and the GPU machine has no 8B checkpoint and no network. This writes one: config.json of the
Llama-3-8B shape, bf16 safetensors shards of random weights (made on the device, the same draw as
engine_decode.py's), the real Llama 3 tokenizer with Meta's Llama 3 Instruct chat template, and
generation_config.json with Llama 3's two end tokens; with the metadata pack_model.py gives a
checkpoint (llgtrt_core/model_store.py's ModelMetadata, engine "pytorch").

It writes straight into the store's staging directory instead of writing a checkpoint directory
for `pack_model.py --hf-dir` to copy: that would hold the 16 GB three times on the disk at once
(source, staging, store), which a 64 GB machine may not have.

    BENTOML_HOME=/tmp/llama-home python bench/random_checkpoint.py             # ~16 GB, cuda
    BENTOML_HOME=/tmp/tiny-home python bench/random_checkpoint.py --tiny       # a few MB, cpu
    python bench/http_load.py --bentoml-home /tmp/llama-home --model llama3-8b-random ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama3 import BOS_TOKEN, CHAT_TEMPLATE, END_OF_TEXT_ID, EOT_ID, EOT_TOKEN, LLAMA3_8B, TINY_LAYERS, tokenizer_json  # noqa: E402
from llgtrt_core.models.llama import ModelConfig  # noqa: E402
from llgtrt_core.models.loader import random_model  # noqa: E402

DEFAULT_NAME = "llama3-8b-random"
SHARD_BYTES = 4 << 30


def tokenizer_config(context_length: int) -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOT_TOKEN,
            "model_max_length": context_length, "chat_template": CHAT_TEMPLATE}


def shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a larger tensor alone)."""
    group: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > max_bytes:
            yield group
            group, size = {}, 0
        group[name] = tensor
        size += nbytes
    if group:
        yield group


def write_checkpoint(dst: Path, config: dict[str, Any], device: torch.device, seed: int) -> None:
    """config, tokenizer files and bf16 safetensors shards of random weights, into `dst`."""
    from safetensors.torch import save_file

    (dst / "config.json").write_text(json.dumps({**config, "model_type": "llama", "torch_dtype": "bfloat16"}))
    (dst / "tokenizer.json").write_text(tokenizer_json())
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config["max_position_embeddings"])))
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": [END_OF_TEXT_ID, EOT_ID]}))
    # max_positions only sizes the rope tables, which a checkpoint does not hold.
    model = random_model(ModelConfig.from_hf(config), 16, torch.bfloat16, device, seed)
    groups = list(shards(model.checkpoint_tensors(), SHARD_BYTES))
    for index, group in enumerate(groups, 1):
        # Packed q/k/v and gate/up are row views: contiguous copies, moved shard by shard to bound host memory.
        cpu = {name: tensor.contiguous().cpu() for name, tensor in group.items()}
        save_file(cpu, str(dst / f"model-{index:05d}-of-{len(groups):05d}.safetensors"), metadata={"format": "pt"})
        del cpu


def store_random_model(name: str, config: dict[str, Any], device: torch.device, seed: int):
    from llgtrt_core.model_store import ModelMetadata, store

    metadata = ModelMetadata(source=f"random:seed{seed}", engine="pytorch", architecture=config["architectures"][0],
                             vocab_size=config["vocab_size"], context_length=config["max_position_embeddings"],
                             has_chat_template=True)
    return store(name, metadata, lambda directory: write_checkpoint(directory, config, device, seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default=DEFAULT_NAME, help="model name in the store ($BENTOML_HOME)")
    parser.add_argument("--tiny", action="store_true", help="2 layers of width 64 (the same vocabulary): a CPU check")
    parser.add_argument("--device", default=None, help="where the weights are drawn (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = {**LLAMA3_8B, **(TINY_LAYERS if args.tiny else {})}
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = store_random_model(args.name, config, device, args.seed)
    print(model.tag)


if __name__ == "__main__":
    main()
