"""Weight-only int8 and int4 matmuls with bfloat16 activations (int4 the CPU default for the
default model, whose projections are Q4_1 blocks) against the float32 model they are quantized
from: same greedy answers, close top-k logprobs, and a corrupted packing fails that same check (so
the tolerance catches a broken kernel). Constrained answers stay valid with the default."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.layers.quantized_linear import Int4Linear, Int8Linear
from llgtrt_core.models.llama import LayersDecode, LlamaForCausalLM
from llgtrt_core.models.loader import load_model

pytestmark = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="the quantized default needs a cpu with bfloat16 kernels")

EOS = frozenset({2})  # <|im_end|> of SmolLM2
QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain how a bicycle works.")
STEPS = 24
TOP_K = 5
# Measured on these prompts (docs/benchmarks/cpu.md): int8 96 % greedy agreement and top-5 logprobs
# within 0.80 nats of float32, int4 99 % and 0.67 (bfloat16 without quantizing: 96 %, 0.45); the
# corrupted packings below: 4 %, 27-36 nats.
LOGPROB_TOLERANCE = 1.2
MIN_GREEDY_AGREEMENT = 0.9


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The engine's own setting on 2 cores (TorchEngineConfig.resolve_cpu_threads): two OpenMP
    threads on a busy machine made these 72 decode steps take minutes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(TorchEngineConfig().resolve_cpu_threads())
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(stored_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stored_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    def chat(question: str) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return [chat(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(stored_model_dir: Path, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    """float32's greedy continuations of each prompt and its logprobs along them."""
    model = load_model(stored_model_dir, 256, torch.float32, torch.device("cpu"))
    runs = [greedy_logprobs(model, prompt) for prompt in prompts]
    return [tokens for tokens, _ in runs], [logprobs for _, logprobs in runs]


def quantized_model(stored_model_dir: Path, weights: str) -> LlamaForCausalLM:
    return load_model(stored_model_dir, 256, torch.bfloat16, torch.device("cpu"), weights)


def greedy_logprobs(model: LlamaForCausalLM, prompt: list[int], forced: list[int] | None = None,
                    layers_decode: LayersDecode | None = None) -> tuple[list[int], torch.Tensor]:
    """STEPS tokens after `prompt`: the model's greedy picks, or `forced` ones fed instead (so two
    models are compared at the same positions); returns them and the logprobs (STEPS, vocab) each
    step saw. The prompt goes through prefill (the dense path), the steps through batch-1 decode
    (the packed kernel), with `layers_decode` when given (a compiled step), their inputs made in
    inference mode as the engine's are (a compiled step's graphs are specific to that)."""
    config = model.config
    dtype = model.model.embed_tokens.weight.dtype
    cache = KVCache(config.num_layers, 1, config.num_kv_heads, config.head_dim, 256, dtype, torch.device("cpu"))
    assert cache.allocate(0, len(prompt) + STEPS)
    cache.sync_table()
    logits = model.extend(torch.tensor(prompt), cache, slot=0)
    tokens, logprobs = [], []
    for step in range(STEPS):
        logprobs.append(logits.float().log_softmax(-1))
        tokens.append(forced[step] if forced else int(logits.argmax()))
        position = len(prompt) + step
        with torch.inference_mode():
            logits = model.decode(torch.tensor([tokens[-1]]), torch.tensor([position]), position + 1, cache,
                                  cache.block_table[:1], layers_decode)[0]
    return tokens, torch.stack(logprobs)


def closeness(model: LlamaForCausalLM, prompts, reference, layers_decode: LayersDecode | None = None
              ) -> tuple[float, float]:
    """(share of steps whose greedy pick equals the reference's, largest top-k logprob difference),
    both along the reference's own continuations (float32's, or another model's)."""
    agree, worst = 0, 0.0
    for prompt, tokens, want in zip(prompts, *reference):
        _, got = greedy_logprobs(model, prompt, forced=tokens, layers_decode=layers_decode)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        top = want.topk(TOP_K, dim=-1).indices
        worst = max(worst, float((got.gather(-1, top) - want.gather(-1, top)).abs().max()))
    return agree / (len(prompts) * STEPS), worst


@pytest.mark.parametrize("weights, kind", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_quantized_matches_float32(stored_model_dir: Path, prompts, reference, tokenizer, weights: str,
                                   kind: type) -> None:
    model = quantized_model(stored_model_dir, weights)
    assert isinstance(model.model.layers[0].mlp.down_proj, kind) and isinstance(model.lm_head, Int8Linear)
    agreement, worst = closeness(model, prompts, reference)
    assert agreement >= MIN_GREEDY_AGREEMENT and worst <= LOGPROB_TOLERANCE, (agreement, worst)
    answer, _ = greedy_logprobs(model, prompts[0])
    assert tokenizer.decode(answer).startswith("The capital of France")


@pytest.mark.parametrize("weights, packed", [("int8", "int8_weight"), ("int4", "int4_weight")])
def test_a_corrupted_packing_fails_the_check(stored_model_dir: Path, prompts, reference, weights: str,
                                             packed: str) -> None:
    """Each down projection's packed rows shifted by one against their scales, as a kernel reading
    the wrong row would: the closeness check above must reject it."""
    model = quantized_model(stored_model_dir, weights)
    for layer in model.model.layers:
        weight = getattr(layer.mlp.down_proj, packed)
        weight.copy_(weight.roll(1, dims=0))
    agreement, worst = closeness(model, prompts, reference)
    assert agreement < MIN_GREEDY_AGREEMENT or worst > LOGPROB_TOLERANCE, (agreement, worst)


def test_the_lm_head_on_more_threads(stored_model_dir: Path) -> None:
    """`logits` on head_threads (the engine runs the lm_head on every core): the same logits from
    the int8 kernel (1 row) and the bfloat16 GEMM (8 rows), and the caller's thread count back."""
    model = quantized_model(stored_model_dir, "int4")
    hidden = torch.randn(8, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    threads = torch.get_num_threads()
    with torch.inference_mode():
        want = [model.logits(hidden[:1]), model.logits(hidden)]
        model.head_threads = threads + 1
        got = [model.logits(hidden[:1]), model.logits(hidden)]
    assert torch.get_num_threads() == threads
    for logits, expected in zip(got, want):
        assert float((logits - expected).abs().max()) <= 1e-2 * float(expected.abs().max())


def test_the_default_is_int4_and_its_constrained_answers_stay_valid(stored_model_dir: Path, tokenizer, prompts) -> None:
    from llgtrt_core.constraints import GrammarCompiler, build_ll_tokenizer
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor
    from llgtrt_core.constraints.request_grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    ll_tokenizer = build_ll_tokenizer(tokenizer, json.loads((stored_model_dir / "config.json").read_text())
                                      ["vocab_size"], sorted(EOS))

    async def scenario() -> list[str]:
        compiler = GrammarCompiler(ll_tokenizer)
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", max_batch_size=4, cpu_compile=False),
                             MaskPostProcessor(ll_tokenizer, max_batch_size=4))
        await engine.start()
        assert isinstance(engine.model.model.layers[0].mlp.down_proj, Int4Linear)
        try:
            grammar = await compiler.compile(json_schema_grammar(schema))

            async def one(i: int, temperature: float) -> str:
                request = GenerationRequest(f"r{i}", prompts[i % len(prompts)],
                                            SamplingParams(max_tokens=80, temperature=temperature, seed=i,
                                                           stop_token_ids=EOS),
                                            compiler.new_constraint(grammar))
                tokens = [t async for delta in engine.generate(request) for t in delta.token_ids]
                return tokenizer.decode([t for t in tokens if t not in EOS])

            return await asyncio.gather(*(one(i, t) for i, t in enumerate((0.0, 0.7, 1.0, 1.3))))
        finally:
            await engine.shutdown()

    for text in asyncio.run(scenario()):
        answer = json.loads(text)
        assert set(answer) == {"name", "age", "city"} and answer["city"] in ("Paris", "London", "Berlin")
        assert len(answer["name"]) <= 20 and 0 <= answer["age"] <= 120


def test_auto_picks_int4_only_when_every_projection_holds_in_int4() -> None:
    """`quantize_weights("auto")`: a model whose projections are int4 groups' values (as the default
    model's, dequantized from Q4_1) gets int4, packed from those groups; one projection off the
    grid makes it int8; random weights are int8."""
    from llgtrt_core.layers.quantized_linear import quantize_int4
    from llgtrt_core.models.llama import ModelConfig
    from llgtrt_core.models.loader import random_model

    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                  "max_position_embeddings": 64, "tie_word_embeddings": False})

    def model(on_grid: bool, off_grid_projection: bool = False) -> LlamaForCausalLM:
        m = random_model(config, 64, torch.float32, torch.device("cpu"), seed=3)
        if on_grid:
            for layer in m.model.layers:
                for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj):
                    q, scales, low = quantize_int4(linear.weight.detach())
                    linear.weight.data.copy_(low.repeat_interleave(32, 1) + q * scales.repeat_interleave(32, 1))
        if off_grid_projection:
            m.model.layers[1].mlp.down_proj.weight.data[0, 0] += 1e-3
        return m

    int4 = model(on_grid=True)
    expected = quantize_int4(int4.model.layers[0].mlp.down_proj.weight.detach())
    assert int4.quantize_weights("auto", torch.bfloat16) == "int4"
    down = int4.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear)
    if down.vnni:
        from llgtrt_core.kernels.cpu_quant import pack_int4

        assert torch.equal(down.int4_weight, pack_int4(*expected)[0])
    else:
        assert torch.equal(down.int4_weight, torch.ops.aten._convert_weight_to_int4pack_for_cpu(expected.q.int(), 1))
    assert model(on_grid=True, off_grid_projection=True).quantize_weights("auto", torch.bfloat16) == "int8"
    random = model(on_grid=False)
    assert random.quantize_weights("auto", torch.bfloat16) == "int8"
    assert isinstance(random.model.layers[0].mlp.down_proj, Int8Linear)
