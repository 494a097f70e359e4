"""The TensorRT-LLM adapter against the REAL TensorRT-LLM, on a user's GPU machine.

Skipped unless `tensorrt_llm` imports (and is not the unit tests' fake) and CUDA is present.
Point LLGTRT_TRTLLM_TEST_MODEL at a small Hugging Face checkpoint directory (PyTorch backend)
and, optionally, LLGTRT_TRTLLM_TEST_ENGINE at a TensorRT engine directory built from it.
Run: `pytest tests/test_trtllm_real.py -v` inside NVIDIA's TensorRT-LLM release container.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

tensorrt_llm = pytest.importorskip("tensorrt_llm")
if getattr(tensorrt_llm, "IS_FAKE", False):
    pytest.skip("the fake tensorrt_llm of the unit tests is on the path", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("TensorRT-LLM needs a CUDA GPU", allow_module_level=True)

from llgtrt_core.constraints.grammar import GrammarCompiler, build_ll_tokenizer  # noqa: E402
from llgtrt_core.constraints.postprocessor import MaskPostProcessor  # noqa: E402
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams  # noqa: E402
from llgtrt_core.engine.trtllm_engine import TrtLlmEngine, TrtLlmEngineConfig  # noqa: E402

CHECKPOINT = os.environ.get("LLGTRT_TRTLLM_TEST_MODEL")
ENGINE_DIR = os.environ.get("LLGTRT_TRTLLM_TEST_ENGINE")

BACKENDS = [
    pytest.param("pytorch", CHECKPOINT, marks=pytest.mark.skipif(not CHECKPOINT, reason="LLGTRT_TRTLLM_TEST_MODEL unset")),
    pytest.param(
        "tensorrt",
        ENGINE_DIR,
        marks=pytest.mark.skipif(not (CHECKPOINT and ENGINE_DIR), reason="LLGTRT_TRTLLM_TEST_ENGINE unset"),
    ),
]


def _build(backend: str, model_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    vocab_size = json.loads((Path(CHECKPOINT) / "config.json").read_text())["vocab_size"]
    ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size, [tokenizer.eos_token_id])
    config = TrtLlmEngineConfig(
        model_dir=model_dir,
        backend=backend,
        vocab_size=vocab_size,
        max_model_len=1024,
        eos_token_id=tokenizer.eos_token_id,
        tokenizer_dir=CHECKPOINT,
        max_batch_size=8,
        kv_cache_free_gpu_memory_fraction=0.3,
    )
    return tokenizer, GrammarCompiler(ll_tokenizer), TrtLlmEngine(config, MaskPostProcessor(ll_tokenizer))


async def _collect(engine, request):
    tokens, reason = [], None
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        reason = delta.finish_reason or reason
    return tokens, reason


@pytest.mark.parametrize("backend, model_dir", BACKENDS)
def test_real_engine_streams_greedy_and_constrained_json(backend, model_dir):
    async def main():
        tokenizer, grammars, engine = _build(backend, model_dir)
        await engine.start()
        try:
            prompt = tokenizer.encode("Name one colour and a number, as JSON:")
            stops = frozenset({tokenizer.eos_token_id})
            free = GenerationRequest("free", prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=stops))
            schema = {
                "type": "object",
                "properties": {"colour": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
                "required": ["colour", "n"],
                "additionalProperties": False,
            }
            compiled = await grammars.compile(json.dumps({"grammars": [{"json_schema": schema}]}))
            constrained = GenerationRequest(
                "json",
                prompt,
                SamplingParams(max_tokens=64, temperature=0.0, stop_token_ids=stops),
                grammars.new_constraint(compiled),
            )
            return tokenizer, await asyncio.gather(_collect(engine, free), _collect(engine, constrained))
        finally:
            await engine.shutdown()

    tokenizer, ((free_tokens, free_reason), (json_tokens, json_reason)) = asyncio.run(main())
    assert free_reason in ("length", "stop") and 0 < len(free_tokens) <= 8
    assert json_reason == "stop"
    parsed = json.loads(tokenizer.decode(json_tokens))
    assert set(parsed) == {"colour", "n"} and isinstance(parsed["n"], int)
