"""The engine's fast path against a plain PyTorch reference forward (no cache, float64, CPU).

A small random Llama runs through the whole engine (continuous batching, the paged KV cache
with preemption, and on CUDA decode CUDA graphs with padded batch buckets): its greedy
tokens must equal those of a from-scratch forward over the full sequence. CUDA cases skip on
machines without a GPU; the CPU case keeps the same reference honest in CI.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llgtrt_core.engine.decode_graphs import PROMPT_ROWS, batch_buckets
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.models.llama import ModelConfig
from llgtrt_core.models.loader import random_model

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
MAX_LEN = 512

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=cuda)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def reference_next_logits(weights: dict[str, torch.Tensor], config: ModelConfig, tokens: list[int]) -> torch.Tensor:
    """Logits after `tokens`, recomputing the whole sequence: multi-head attention with repeated KV heads."""
    seq, heads, kv_heads, head_dim = len(tokens), config.num_heads, config.num_kv_heads, config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = weights["model.embed_tokens.weight"][tokens]
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        w = {name[len(prefix):]: t for name, t in weights.items() if name.startswith(prefix)}
        h = rms_norm(x, w["input_layernorm.weight"], config.rms_norm_eps)
        q = (h @ w["self_attn.q_proj.weight"].T).view(seq, heads, head_dim).transpose(0, 1)
        k = (h @ w["self_attn.k_proj.weight"].T).view(seq, kv_heads, head_dim).transpose(0, 1)
        v = (h @ w["self_attn.v_proj.weight"].T).view(seq, kv_heads, head_dim).transpose(0, 1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        scores = (q @ k.transpose(1, 2) / head_dim**0.5).masked_fill(~causal, float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(seq, heads * head_dim)
        x = x + attended @ w["self_attn.o_proj.weight"].T
        h = rms_norm(x, w["post_attention_layernorm.weight"], config.rms_norm_eps)
        gated = F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
        x = x + gated @ w["mlp.down_proj.weight"].T
    x = rms_norm(x, weights["model.norm.weight"], config.rms_norm_eps)
    return x[-1] @ weights["lm_head.weight"].T


def reference_greedy(weights, config: ModelConfig, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_next_logits(weights, config, tokens).argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def run_engine(engine: TorchEngine, requests: list[GenerationRequest]) -> list[list[int]]:
    async def collect(request: GenerationRequest) -> list[int]:
        return [t async for delta in engine.generate(request) for t in delta.token_ids]

    async def scenario() -> list[list[int]]:
        await engine.start()
        try:
            return list(await asyncio.gather(*(collect(r) for r in requests)))
        finally:
            await engine.shutdown()

    return asyncio.run(scenario())


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_equal_the_reference_forward(model_dir: Path, device: str) -> None:
    """float32 engine, five requests through three rows: joins, leaves, compaction, and on CUDA
    the Triton decode ops under graphs for batch buckets 1, 2 and 3 (padded), one graph per
    bucket whatever the rows' lengths (a prompt of 300 beside short ones)."""
    config = ModelConfig.from_hf(TINY_LLAMA)
    model = random_model(config, MAX_LEN, torch.float32, torch.device(device), seed=1)
    weights = {name: t.double().cpu() for name, t in model.checkpoint_tensors().items()}
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (5, 17, 300, 9, 40)]
    max_tokens = [12, 4, 10, 7, 20]
    engine = TorchEngine(model_dir, TorchEngineConfig(max_batch_size=3, max_model_len=MAX_LEN, device=device,
                                                      dtype="float32"), model=model)
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.0))
                for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    got = run_engine(engine, requests)
    expected = [reference_greedy(weights, config, p, m) for p, m in zip(prompts, max_tokens)]
    assert got == expected
    if device == "cuda":
        assert engine.runner.decode_graphs is not None
        graphs = engine.runner.decode_graphs
        assert graphs.max_rows == 3 + PROMPT_ROWS  # the slots, and prompt tokens riding along
        assert set(graphs.graphs) == set(batch_buckets(graphs.max_rows))  # every bucket, captured at start


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_and_chunked_prefill_keep_the_reference_tokens(model_dir: Path, device: str) -> None:
    """Four requests needing 1,110 positions share a 512-token paged cache, prompts prefilled 32
    tokens a step: sequences are preempted and recomputed (on CUDA beside graph decode with
    overlapped steps), and each still gets the reference's greedy tokens."""
    config = ModelConfig.from_hf(TINY_LLAMA)
    model = random_model(config, MAX_LEN, torch.float32, torch.device(device), seed=8)
    weights = {name: t.double().cpu() for name, t in model.checkpoint_tensors().items()}
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (200, 150, 180, 100)]
    engine = TorchEngine(model_dir, TorchEngineConfig(max_batch_size=4, max_model_len=MAX_LEN, device=device,
                                                      dtype="float32", kv_cache_max_tokens=MAX_LEN,
                                                      prefill_chunk_tokens=32), model=model)
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=120, temperature=0.0))
                for i, p in enumerate(prompts)]
    got = run_engine(engine, requests)
    assert engine.num_preemptions > 0
    assert got == [reference_greedy(weights, config, p, 120) for p in prompts]


@pytest.mark.parametrize("device", DEVICES)
def test_cached_prefixes_keep_the_reference_tokens(model_dir: Path, device: str) -> None:
    """Prefix caching (on CUDA beside graph decode and overlapped steps): a first request caches its
    prompt's full blocks; three more share 40 or 67 of its tokens and run at once, prefilling only
    past the cached blocks (usage's cached_tokens: whole 16-token blocks). Every answer has the
    reference's greedy tokens, and the tokens and logprobs of the same engine without the cache."""
    config = ModelConfig.from_hf(TINY_LLAMA)
    model = random_model(config, MAX_LEN, torch.float32, torch.device(device), seed=11)
    weights = {name: t.double().cpu() for name, t in model.checkpoint_tensors().items()}
    generator = torch.Generator().manual_seed(12)
    shared = torch.randint(0, 512, (70,), generator=generator).tolist()
    prompts = [shared, shared[:40] + [5, 6, 7], shared[:67] + [9], shared[:40] + [8] * 20]

    def run(prefix_caching: bool) -> list[tuple[list[int], list[float], int]]:
        engine = TorchEngine(model_dir, TorchEngineConfig(max_batch_size=4, max_model_len=MAX_LEN, device=device,
                                                          dtype="float32", prefix_caching=prefix_caching), model=model)

        async def collect(request: GenerationRequest) -> tuple[list[int], list[float], int]:
            tokens, logprobs, cached = [], [], 0
            async for delta in engine.generate(request):
                tokens += delta.token_ids
                logprobs += [lp.logprob for lp in delta.logprobs or []]
                cached = delta.cached_tokens if delta.cached_tokens is not None else cached
            return tokens, logprobs, cached

        async def scenario() -> list[tuple[list[int], list[float], int]]:
            await engine.start()
            try:
                requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0))
                            for i, p in enumerate(prompts)]
                first = await collect(requests[0])
                return [first, *await asyncio.gather(*(collect(r) for r in requests[1:]))]
            finally:
                await engine.shutdown()

        return asyncio.run(scenario())

    cached, uncached = run(True), run(False)
    assert [c for _, _, c in cached] == [0, 32, 64, 32] and [c for _, _, c in uncached] == [0] * 4
    assert [tokens for tokens, _, _ in cached] == [reference_greedy(weights, config, p, 8) for p in prompts]
    assert [tokens for tokens, _, _ in uncached] == [tokens for tokens, _, _ in cached]
    for (_, with_cache, _), (_, without, _) in zip(cached, uncached):
        assert len(with_cache) == 8 and max(abs(a - b) for a, b in zip(with_cache, without)) < 1e-3


@cuda
def test_bf16_graph_decode_logits_track_the_reference() -> None:
    """bf16 on CUDA with graphs: next-token logits after prefill + decode stay within bf16 error."""
    from llgtrt_core.engine.decode_graphs import DecodeGraphs
    from llgtrt_core.engine.kv_cache import KVCache

    config = ModelConfig.from_hf(TINY_LLAMA)
    device = torch.device("cuda")
    model = random_model(config, MAX_LEN, torch.bfloat16, device, seed=3)
    weights = {name: t.double().cpu() for name, t in model.checkpoint_tensors().items()}
    cache = KVCache.for_device(config.num_layers, 4, config.num_kv_heads, config.head_dim, MAX_LEN, torch.bfloat16,
                               device)
    graphs = DecodeGraphs(model, cache)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 30, 70)]
    for slot, prompt in enumerate(prompts):
        assert cache.allocate(slot, len(prompt) + 1)
    cache.sync_table()
    for slot, prompt in enumerate(prompts):
        model.extend(torch.tensor(prompt, device=device), cache, slot)
    next_tokens = [7, 8, 9]
    positions = [len(p) for p in prompts]
    logits = graphs.decode(torch.tensor(next_tokens, device=device),
                           torch.tensor(positions, device=device)).double().cpu()
    for row, (prompt, token) in enumerate(zip(prompts, next_tokens)):
        expected = reference_next_logits(weights, config, prompt + [token])
        relative = (logits[row] - expected).norm() / expected.norm()
        assert relative < 3e-2, (row, float(relative))


@pytest.mark.parametrize("device", DEVICES)
def test_one_mixed_pass_gives_the_decode_and_prefill_logits_of_the_reference(device: str) -> None:
    """`mixed`: two rows decode a token while two prompts (one from 0, one continuing a cached
    prefix, as a chunked prefill does) run in the same pass; every row's logits match the reference."""
    from llgtrt_core.engine.kv_cache import KVCache
    from llgtrt_core.models.llama import Segment

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = ModelConfig.from_hf(TINY_LLAMA)
    model = random_model(config, MAX_LEN, dtype, torch.device(device), seed=5)
    weights = {name: t.double().cpu() for name, t in model.checkpoint_tensors().items()}
    cache = KVCache.for_device(config.num_layers, 4, config.num_kv_heads, config.head_dim, MAX_LEN, dtype,
                               torch.device(device))
    generator = torch.Generator().manual_seed(6)
    decoding = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (9, 40)]
    fresh, continued = (torch.randint(0, 512, (n,), generator=generator).tolist() for n in (21, 37))
    for slot, tokens in enumerate([*decoding, fresh, continued]):
        assert cache.allocate(slot, len(tokens) + 1)
    cache.sync_table()
    for slot, prompt in enumerate(decoding):
        model.extend(torch.tensor(prompt, device=device), cache, slot)
    model.extend(torch.tensor(continued[:16], device=device), cache, 3)  # the cached first chunk
    next_tokens = [11, 12]
    logits = model.mixed(torch.tensor(next_tokens, device=device),
                         torch.tensor([len(p) for p in decoding], device=device), 41, cache, cache.block_table[:2],
                         torch.tensor(fresh + continued[16:], device=device),
                         [Segment(2, 0, len(fresh)), Segment(3, 16, len(continued) - 16)]).double().cpu()
    expected = [reference_next_logits(weights, config, tokens)
                for tokens in (decoding[0] + [11], decoding[1] + [12], fresh, continued)]
    tolerance = 1e-4 if device == "cpu" else 3e-2
    for row, want in enumerate(expected):
        relative = (logits[row] - want).norm() / want.norm()
        assert relative < tolerance, (row, float(relative))


@cuda
def test_triton_decode_equals_the_torch_ops_for_a_qwen3_shape() -> None:
    """float32 Qwen3 shape (q/k norms fused into the RoPE kernel, qkv biases): the Triton decode
    ops give the torch ops' logits and write the same keys and values."""
    from llgtrt_core.engine.kv_cache import KVCache

    config = ModelConfig.from_hf({**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32,
                                  "attention_bias": True})
    device = torch.device("cuda")
    model = random_model(config, MAX_LEN, torch.float32, device, seed=6)
    for name, parameter in model.named_parameters():  # random_model sets norms to 1: make them matter
        if name.endswith("norm.weight"):
            parameter.data.uniform_(0.5, 1.5)
    caches = [KVCache.for_device(config.num_layers, 3, config.num_kv_heads, config.head_dim, MAX_LEN, torch.float32,
                                 device) for _ in range(2)]
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (4, 100, 260)]
    token_ids = torch.tensor([5, 6, 7], device=device)
    positions = torch.tensor([len(p) for p in prompts], device=device)
    logits = []
    for cache, fused in zip(caches, (True, False)):
        model.fused_ops = fused
        for slot, prompt in enumerate(prompts):
            assert cache.allocate(slot, len(prompt) + 1)
        cache.sync_table()
        for slot, prompt in enumerate(prompts):
            model.extend(torch.tensor(prompt, device=device), cache, slot)
        logits.append(model.decode(token_ids, positions, int(positions.max()) + 1, cache, cache.block_table[:3]))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    for fused_layer, plain_layer in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        torch.testing.assert_close(fused_layer, plain_layer, rtol=1e-5, atol=1e-5)


def run_with_grammar(model_dir: Path, model, device: str, post_processor, compiler, compiled,
                     samplings: list[SamplingParams], plain_max_tokens: int, **config) -> tuple[list[list[int]], TorchEngine]:
    """One constrained request per sampling (prompts 10+i..29+i) and a plain greedy one (40..59) on a
    fresh engine of the tiny model: each one's tokens, and the engine."""
    engine = TorchEngine(model_dir, TorchEngineConfig(max_batch_size=len(samplings) + 1, max_model_len=MAX_LEN,
                                                      device=device, dtype="float32", **config),
                         post_processor, model=model)
    requests = [GenerationRequest(f"c{i}", list(range(10 + i, 30 + i)), sampling, compiler.new_constraint(compiled))
                for i, sampling in enumerate(samplings)]
    requests.append(GenerationRequest("plain", list(range(40, 60)),
                                      SamplingParams(max_tokens=plain_max_tokens, temperature=0.0)))
    return run_engine(engine, requests), engine


@pytest.mark.parametrize("device", DEVICES)
def test_fast_forward_gives_the_same_constrained_tokens_in_fewer_steps(model_dir: Path, device: str) -> None:
    """Forced runs appended with extend() (on CUDA beside graph decode) change nothing but the step
    count. llguidance's byte tokenizer (262 tokens) is narrower than the model (512): the tail is
    masked, so every output is a schema-valid JSON document."""
    from llguidance import LLTokenizer

    from llgtrt_core.constraints import GrammarCompiler
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor
    from llgtrt_core.constraints.request_grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    byte_tokenizer = LLTokenizer("byte")
    eos = frozenset(byte_tokenizer.eos_tokens)
    config = ModelConfig.from_hf(TINY_LLAMA)
    model = random_model(config, MAX_LEN, torch.float32, torch.device(device), seed=5)

    def run(fast_forward: bool) -> tuple[list[list[int]], int]:
        compiler = GrammarCompiler(byte_tokenizer)
        compiled = asyncio.run(compiler.compile(json_schema_grammar(schema)))
        sampling = SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=eos)
        tokens, engine = run_with_grammar(model_dir, model, device, MaskPostProcessor(byte_tokenizer, max_batch_size=3),
                                          compiler, compiled, [sampling, sampling], 20, fast_forward=fast_forward)
        compiler.close()
        return tokens, engine.num_steps

    plain_tokens, plain_steps = run(fast_forward=False)
    fast_tokens, fast_steps = run(fast_forward=True)
    assert fast_tokens == plain_tokens
    assert fast_steps < plain_steps
    for tokens in fast_tokens[:2]:
        document = json.loads(bytes(tokens))
        assert document["color"] in ("red", "green", "blue") and isinstance(document["ok"], bool)


@pytest.mark.gpu
@cuda
def test_the_device_waiting_for_the_masks_draws_what_the_engine_thread_waiting_would(model_dir: Path) -> None:
    """On CUDA a step's draw waits for its masks on the device (HostGate), the engine thread queuing
    it and the next decode meanwhile: with every fill 5 ms late (the device waits each step) and
    rows leaving at different lengths (the fill begun ahead still holds their rows, skipped), the
    tokens are those of the engine thread waiting for each fill."""
    from llguidance import LLTokenizer

    from llgtrt_core.constraints import GrammarCompiler
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor
    from llgtrt_core.constraints.request_grammar import json_schema_grammar

    class LateFill(MaskPostProcessor):
        def fill(self, rows, offset=0):
            time.sleep(0.005)
            return super().fill(rows, offset)

        def upload(self, rows, masks, device, stream=None, gate=None):
            self.gated.append(gate is not None)
            return super().upload(rows, masks, device, stream, gate)

    schema = {"type": "object", "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["note", "n"], "additionalProperties": False}
    byte_tokenizer = LLTokenizer("byte")
    eos = frozenset(byte_tokenizer.eos_tokens)
    model = random_model(ModelConfig.from_hf(TINY_LLAMA), MAX_LEN, torch.float32, torch.device("cuda"), seed=9)
    samplings = [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=eos),
                 SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=eos),
                 SamplingParams(max_tokens=25, temperature=0.9, seed=3, stop_token_ids=eos)]

    def run(device_waits: bool) -> list[list[int]]:
        compiler = GrammarCompiler(byte_tokenizer)
        compiled = asyncio.run(compiler.compile(json_schema_grammar(schema)))
        post_processor = LateFill(byte_tokenizer, max_batch_size=4)
        post_processor.gated = []
        tokens, _ = run_with_grammar(model_dir, model, "cuda", post_processor, compiler, compiled, samplings, 30,
                                     fast_forward=False, device_waits_for_masks=device_waits)
        assert post_processor.gated and set(post_processor.gated) == {device_waits}  # every step's draw
        compiler.close()
        return tokens

    waited_on_device = run(device_waits=True)
    assert waited_on_device == run(device_waits=False)
    assert len({len(tokens) for tokens in waited_on_device[:3]}) > 1  # the rows left at different steps


def test_decode_batch_buckets_step_by_16_to_256_then_by_32() -> None:
    from llgtrt_core.engine.decode_graphs import batch_buckets

    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(300)[:7] == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(300)[-3:] == [256, 288, 300]


@pytest.mark.parametrize("device", DEVICES)
def test_slow_grammar_rows_that_sit_out_draw_what_waiting_would(model_dir: Path, device: str) -> None:
    """A slow grammar's rows, filled apart, whose masks miss their steps (made certain: each fill
    apart ends 20 ms late, test_slow_grammar_rows.py) sit them out; on CUDA under graphs, overlapped
    steps and the fused sampler. Greedy and seeded fused draws are made again alike, a seeded top-p
    row (its generator would move on) never sits out: every request gets the tokens it gets when
    every step waits for its masks."""
    from llguidance import LLTokenizer

    from llgtrt_core.constraints import GrammarCompiler
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor
    from llgtrt_core.constraints.request_grammar import json_schema_grammar

    class LateMaskPostProcessor(MaskPostProcessor):
        def fill_apart(self, rows):
            time.sleep(0.02)
            return super().fill_apart(rows)

    schema = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["note", "ok"], "additionalProperties": False}
    byte_tokenizer = LLTokenizer("byte")
    eos = frozenset(byte_tokenizer.eos_tokens)
    model = random_model(ModelConfig.from_hf(TINY_LLAMA), MAX_LEN, torch.float32, torch.device(device), seed=7)
    samplings = [SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=eos),
                 SamplingParams(max_tokens=48, temperature=0.9, seed=11, stop_token_ids=eos),
                 SamplingParams(max_tokens=48, temperature=0.9, top_p=0.8, seed=12, stop_token_ids=eos)]

    def run(slow: bool) -> tuple[list[list[int]], int]:
        compiler = GrammarCompiler(byte_tokenizer)
        compiled = asyncio.run(compiler.compile(json_schema_grammar(schema)))
        if slow:
            compiled.mask_cost.mark_slow()
        tokens, engine = run_with_grammar(model_dir, model, device, LateMaskPostProcessor(byte_tokenizer, max_batch_size=4),
                                          compiler, compiled, samplings, 30, fast_forward=False)
        compiler.close()
        return tokens, engine.num_sit_outs

    waited, none_sat_out = run(slow=False)
    sat, sit_outs = run(slow=True)
    assert none_sat_out == 0 and sit_outs > 0
    assert sat == waited
    for tokens in sat[:3]:
        document = json.loads(bytes(tokens))
        assert isinstance(document["note"], str) and isinstance(document["ok"], bool)
