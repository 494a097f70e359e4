"""The CPU decode step with compiled layers (engine/compiled_decode.py) against the eager step it
replaces, on the int4 default: along float32's greedy continuations its picks and logprobs stay as
close to float32's as the eager step's do and close to the eager step's own; a decode over rows
at different positions (the batched graphs) gives logprobs close to the eager step's; an engine
switches to it once compiled, and its constrained answers stay valid.

Compiling takes ~30 s of an idle core and minutes of a busy one: `slow` (`make test-all`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import pytest
import torch

from llgtrt_core.engine.compiled_decode import CompiledDecode
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.kernels import cpu_quant
from llgtrt_core.layers.quantized_linear import VNNI_MAX_ROWS, Int4Linear
from llgtrt_core.models.llama import torch_threads
from test_quantized_weights import (EOS, LOGPROB_TOLERANCE, MIN_GREEDY_AGREEMENT, TOP_K, closeness,  # noqa: F401
                               greedy_logprobs, one_thread, prompts, quantized_model, reference, tokenizer)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                 reason="the quantized default needs a cpu with bfloat16 kernels")]

COMPILE_TIMEOUT_S = 900
# Compiled against eager along eager's greedy continuations of these prompts, measured: 96 % (69/72)
# equal picks (near-ties: bfloat16 rounds differently where inductor fuses), top-5 logprobs within
# 0.24 nats; a broken kernel is tens of nats off (test_quantized_weights).
EAGER_TOLERANCE = 0.5
# The batched graphs of both matmul paths: the packed kernel's rows (ours, or aten's) and beyond.
MAX_BATCH = (VNNI_MAX_ROWS if cpu_quant.available() else Int4Linear.max_rows) + 1
TEMPLATE_ROWS = 8  # rows of the graph on inductor's int4 GEMM template (TEMPLATE_MIN_ROWS..Int4Linear.max_rows)
PROMPT_THREADS = 2  # a prompt-only step's graph on more threads than the step's (CompiledDecode.prompt_stance)


@pytest.fixture(scope="module")
def compiled(stored_model_dir: Path):
    model = quantized_model(stored_model_dir, "int4")  # the default's
    geometry = KVCache(model.config.num_layers, MAX_BATCH, model.config.num_kv_heads, model.config.head_dim, 256,
                       torch.bfloat16, torch.device("cpu"))
    # As the engine compiles it: GEMM templates (and a prompt graph on more threads) for aten's matmuls only.
    compiled = CompiledDecode(model, geometry, on_miss="fail_on_recompile",  # a step must find its graph
                              gemm_templates=not model.uses_cpu_kernels(), prompt_threads=PROMPT_THREADS)
    compiled.start()
    assert compiled.wait(COMPILE_TIMEOUT_S), "the compile failed or timed out (see the log)"
    return model, compiled


def test_compiled_step_matches_eager_and_float32(compiled, prompts, reference) -> None:
    model, compiled = compiled
    with compiled.stance():
        agreement, worst = closeness(model, prompts, reference, compiled.layers_decode())
    assert agreement >= MIN_GREEDY_AGREEMENT and worst <= LOGPROB_TOLERANCE, (agreement, worst)
    eager = [greedy_logprobs(model, prompt) for prompt in prompts]
    eager_reference = ([tokens for tokens, _ in eager], [logprobs for _, logprobs in eager])
    with compiled.stance():
        agreement, worst = closeness(model, prompts, eager_reference, compiled.layers_decode())
    assert agreement >= MIN_GREEDY_AGREEMENT and worst <= EAGER_TOLERANCE, (agreement, worst)


@pytest.mark.parametrize("batch", [3, TEMPLATE_ROWS, MAX_BATCH])
def test_batched_rows_at_different_positions(compiled, prompts, batch: int) -> None:
    """Rows of different lengths in one decode: each row's top logprobs close to the eager step's."""
    model, compiled = compiled
    config = model.config
    cache = KVCache(config.num_layers, batch, config.num_kv_heads, config.head_dim, 256, torch.bfloat16,
                    torch.device("cpu"))
    rows = [prompts[i % len(prompts)][: 40 - i] for i in range(batch)]  # up to 33 rows: 40 to 8 tokens
    tokens = []
    for row, prompt in enumerate(rows):
        assert cache.allocate(row, len(prompt) + 1)
        cache.sync_table()
        tokens.append(int(model.extend(torch.tensor(prompt), cache, slot=row).argmax()))
    with torch.inference_mode():  # the step's inputs as the engine makes them
        positions = torch.tensor([len(prompt) for prompt in rows])
        step = (torch.tensor(tokens), positions, int(positions.max()) + 1, cache, cache.block_table[:batch])
        eager = model.decode(*step).log_softmax(-1)
        with compiled.stance():
            got = model.decode(*step, compiled.layers_decode()).log_softmax(-1)
    top = eager.topk(TOP_K, dim=-1).indices
    assert float((got.gather(-1, top) - eager.gather(-1, top)).abs().max()) <= EAGER_TOLERANCE


@pytest.mark.parametrize("batch", [1, 3])
def test_keys_within_one_block_run_compiled(compiled, batch: int) -> None:
    """Fewer keys than a block (dynamo specializes a block count of 1: a graph of their own): the
    step finds its graph, logprobs close to the eager step's."""
    model, compiled = compiled
    config = model.config
    cache = KVCache(config.num_layers, batch, config.num_kv_heads, config.head_dim, 256, torch.bfloat16,
                    torch.device("cpu"))
    for row in range(batch):
        assert cache.allocate(row, 8)
    cache.sync_table()
    with torch.inference_mode():  # the step's inputs as the engine makes them
        positions = torch.arange(batch) + 2
        step = (torch.arange(batch) + 100, positions, int(positions.max()) + 1, cache, cache.block_table[:batch])
        eager = model.decode(*step).log_softmax(-1)
        with compiled.stance():
            got = model.decode(*step, compiled.layers_decode()).log_softmax(-1)
    top = eager.topk(TOP_K, dim=-1).indices
    assert float((got.gather(-1, top) - eager.gather(-1, top)).abs().max()) <= EAGER_TOLERANCE


@pytest.mark.parametrize("new_tokens,threads", [(4, 1), (TEMPLATE_ROWS, 1), (TEMPLATE_ROWS, PROMPT_THREADS),
                                               (MAX_BATCH, 1)])
def test_prompt_tokens_ride_the_compiled_step(compiled, prompts, new_tokens: int, threads: int) -> None:
    """A prompt's next tokens as rows of the compiled step, each at its own position of the same
    cache row (how the engine prefills a short chunk, model_runner.py; on more threads in a step
    that only prefills them): the last token's logprobs close to an eager `extend` of the same
    tokens, and the keys written let a decode go on alike."""
    model, compiled = compiled
    if threads > 1 and not compiled.gemm_templates:
        pytest.skip("a prompt graph on more threads is compiled with GEMM templates only")
    config = model.config
    prompt = prompts[0]
    cached, new = prompt[: len(prompt) - new_tokens], prompt[len(prompt) - new_tokens:]
    caches = []
    for _ in range(2):
        cache = KVCache(config.num_layers, 1, config.num_kv_heads, config.head_dim, 256, torch.bfloat16,
                        torch.device("cpu"))
        assert cache.allocate(0, len(prompt) + 1)
        cache.sync_table()
        model.extend(torch.tensor(cached), cache, slot=0)
        caches.append(cache)
    eager_cache, rows_cache = caches
    eager = model.extend(torch.tensor(new), eager_cache, slot=0, start=len(cached)).float().log_softmax(-1)
    table = torch.zeros(MAX_BATCH, rows_cache.block_table.shape[1], dtype=torch.long)  # a normal tensor, as the runner's
    with torch.inference_mode():  # the step's inputs as the engine makes them
        positions = torch.arange(len(cached), len(prompt))
        table = torch.index_select(rows_cache.block_table, 0, torch.zeros(new_tokens, dtype=torch.long),
                                   out=table[:new_tokens])
        with torch_threads(threads), compiled.stance():  # a graph compiled at that count, or a miss raises
            got = model.decode(torch.tensor(new), positions, len(prompt), rows_cache, table,
                               compiled.layers_decode(), picked=torch.tensor([new_tokens - 1]))[0].float().log_softmax(-1)
    top = eager.topk(TOP_K).indices
    assert float((got[top] - eager[top]).abs().max()) <= EAGER_TOLERANCE
    with torch.inference_mode():
        step = (torch.tensor([int(eager.argmax())]), torch.tensor([len(prompt)]), len(prompt) + 1)
        after = [model.decode(*step, cache, cache.block_table[:1]).log_softmax(-1)[0] for cache in caches]
    top = after[0].topk(TOP_K).indices
    assert float((after[1][top] - after[0][top]).abs().max()) <= EAGER_TOLERANCE


def test_engine_switches_to_the_compiled_step(compiled, stored_model_dir: Path, tokenizer, prompts) -> None:
    """An engine compiling in the background serves meanwhile, then decodes with the compiled
    layers (none missing: a miss raises here): a greedy answer as the eager step's starts, and
    constrained answers stay valid."""
    from llgtrt_core.constraints import GrammarCompiler, build_ll_tokenizer
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor
    from llgtrt_core.constraints.request_grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]},
                                               "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
              "required": ["city", "year"], "additionalProperties": False}
    ll_tokenizer = build_ll_tokenizer(tokenizer, json.loads((stored_model_dir / "config.json").read_text())
                                      ["vocab_size"], sorted(EOS))

    async def scenario() -> tuple[str, list[str]]:
        grammars = GrammarCompiler(ll_tokenizer)
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", max_batch_size=4, cpu_compile=True),
                             MaskPostProcessor(ll_tokenizer, max_batch_size=4))
        await engine.start()
        try:
            compiled_decode = engine.runner.compiled_decode
            assert compiled_decode.layers_decode() is None  # eager until compiled
            compiled_decode.on_miss = "fail_on_recompile"  # a step must find its graph
            assert await asyncio.to_thread(compiled_decode.wait, COMPILE_TIMEOUT_S)
            grammar = await grammars.compile(json_schema_grammar(schema))

            async def one(i: int, constrained: bool) -> str:
                request = GenerationRequest(f"r{i}{constrained}", prompts[i],
                                            SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=EOS),
                                            grammars.new_constraint(grammar) if constrained else None)
                tokens = [t async for delta in engine.generate(request) for t in delta.token_ids]
                return tokenizer.decode([t for t in tokens if t not in EOS])

            greedy = await one(0, constrained=False)
            return greedy, list(await asyncio.gather(*(one(i, True) for i in range(len(prompts)))))
        finally:
            await engine.shutdown()

    greedy, constrained = asyncio.run(scenario())
    assert greedy.startswith("The capital of France"), greedy
    for text in constrained:
        answer = json.loads(text)
        assert answer["city"] in ("Paris", "London") and 1000 <= answer["year"] <= 2100


def test_engine_serves_while_it_compiles(stored_model_dir: Path, prompts) -> None:
    """Waves of requests while the engine's own compile runs: its eager steps beside the compile
    thread's traces (compiled_decode.TRACING) and warm-up runs, both on our kernels' helper threads
    (session 15: a NameError failed a step's requests, a SIGSEGV killed the engine process). Every
    request ends normally, the compile finishes, and the engine then serves compiled."""
    async def collect(engine: TorchEngine, request: GenerationRequest) -> tuple[Optional[str], int]:
        tokens, reason = 0, None
        async for delta in engine.generate(request):
            tokens += len(delta.token_ids)
            reason = delta.finish_reason or reason
        return reason, tokens

    async def scenario() -> tuple[list[tuple[Optional[str], int]], bool]:
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", max_batch_size=4, cpu_compile=True))
        await engine.start()
        try:
            compiled_decode = engine.runner.compiled_decode
            ended, wave = [], 0
            while compiled_decode.compiling:
                ended += await asyncio.gather(*(collect(engine, GenerationRequest(
                    f"w{wave}r{i}", prompts[i % len(prompts)],
                    SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=EOS))) for i in range(4)))
                wave += 1
            assert await asyncio.to_thread(compiled_decode.wait, COMPILE_TIMEOUT_S)
            ended += [await collect(engine, GenerationRequest("after", prompts[0], SamplingParams(
                max_tokens=8, temperature=0.0, stop_token_ids=EOS)))]
            return ended, compiled_decode.layers_decode() is not None
        finally:
            await engine.shutdown()

    ended, compiled_in_the_end = asyncio.run(scenario())
    assert compiled_in_the_end
    assert len(ended) > 4, "no wave ran during the compile"
    assert all(reason in ("stop", "length") and tokens > 0 for reason, tokens in ended), ended
