"""The post-processor object the TensorRT-LLM adapter hands to TensorRT-LLM is the one the
embedded engine drives end to end: the constraint path is one piece of code for both engines.

No TensorRT-LLM is needed (nor faked): building the adapter does not import it; only
`start()` would."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from llgtrt_core.constraints import GrammarCompiler, build_ll_tokenizer
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.engine.trtllm_engine import TrtLlmEngine, TrtLlmEngineConfig
from llgtrt_core.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", ["tensorrt", "pytorch"])
def test_the_adapters_post_processor_drives_the_embedded_engine(stored_model_dir: Path, backend: str) -> None:
    tokenizer = Tokenizer(stored_model_dir)
    vocab_size = json.loads((stored_model_dir / "config.json").read_text())["vocab_size"]
    ll_tokenizer = build_ll_tokenizer(tokenizer.hf, vocab_size, sorted(tokenizer.eos_token_ids))
    post_processor = MaskPostProcessor(ll_tokenizer, max_batch_size=2)

    adapter = TrtLlmEngine(
        TrtLlmEngineConfig(model_dir=str(stored_model_dir), backend=backend, vocab_size=vocab_size,
                           max_model_len=512, eos_token_id=tokenizer.hf.eos_token_id),
        post_processor,
    )
    assert adapter.postprocessor is post_processor
    if backend == "tensorrt":  # the batched processor registered at LLM construction wraps it
        assert adapter.batched_processor.postprocessor is post_processor

    async def generate() -> tuple[str, str]:
        compiler = GrammarCompiler(ll_tokenizer)
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", max_batch_size=2, cpu_compile=False),
                             adapter.postprocessor)
        await engine.start()
        try:
            compiled = await compiler.compile(json_schema_grammar(SCHEMA))
            prompt = tokenizer.encode("A city and its population, as JSON:")
            request = GenerationRequest("c", prompt, SamplingParams(max_tokens=60, temperature=0.0,
                                                                    stop_token_ids=tokenizer.eos_token_ids),
                                        compiler.new_constraint(compiled))
            tokens, reason = [], None
            async for delta in engine.generate(request):
                tokens += delta.token_ids
                reason = delta.finish_reason
            return tokenizer.decode(tokens), reason
        finally:
            await engine.shutdown()
            compiler.close()

    text, reason = asyncio.run(generate())
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
