"""Bitmask application and fused constrained sampling: the torch paths (CPU, in CI) and the CUDA
kernels (skipped without CUDA).

Every case is checked against a token-by-token reference (`allowed_reference`), written apart
from both implementations; llguidance's own masks pin the bit layout.
"""

from __future__ import annotations

from typing import Optional

import llguidance
import pytest
import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

from llgtrt_core.kernels import apply_token_bitmask_inplace, cuda_kernel_available
from llgtrt_core.kernels.sampling import sample_with_bitmask, sample_with_bitmask_torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def allowed_reference(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N, vocab) bool, token by token: bit t%32 of word t//32, False past 32 * words."""
    tokens = torch.arange(vocab, device=bitmask.device)
    word_index = tokens // 32
    in_mask = word_index < bitmask.shape[1]
    words = bitmask[:, word_index.clamp(max=bitmask.shape[1] - 1)]
    return (((words >> (tokens % 32)) & 1) == 1) & in_mask


def expected_after_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]]) -> torch.Tensor:
    expected = logits.detach().clone()
    allowed = allowed_reference(bitmask.to(logits.device), logits.shape[1])
    index = torch.arange(logits.shape[0]) if rows is None else torch.tensor(rows, dtype=torch.int64)
    index = index.to(logits.device)
    expected[index] = torch.where(allowed, expected[index], float("-inf"))
    return expected


def random_bitmask(rows: int, vocab: int, allowed_fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Packed mask (on the generator's device), each token allowed with probability `allowed_fraction`."""
    words = (vocab + 31) // 32
    bits = torch.rand(rows, words, 32, generator=generator, device=generator.device) < allowed_fraction
    packed = torch.zeros(rows, words, dtype=torch.int32, device=generator.device)
    for bit in range(32):
        packed |= bits[:, :, bit].to(torch.int32) << bit  # bit 31 lands in the sign, as int32 wants
    return packed


def check(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]] = None, **kwargs) -> None:
    expected = expected_after_mask(logits, bitmask, rows)
    apply_token_bitmask_inplace(logits, bitmask, rows, **kwargs)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 4099])
@pytest.mark.parametrize("allowed_fraction", [0.0, 0.01, 0.5, 0.99, 1.0])
def test_matches_reference(device: str, dtype: torch.dtype, vocab: int, allowed_fraction: float) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator).to(device=device, dtype=dtype)
    check(logits, random_bitmask(5, vocab, allowed_fraction, generator).to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_logits_wider_than_mask_mask_the_tail(device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 100, generator=generator, device="cpu").to(device)
    bitmask = torch.full((3, 2), -1, dtype=torch.int32, device=device)  # 64 tokens, all allowed
    apply_token_bitmask_inplace(logits, bitmask)
    assert torch.isfinite(logits[:, :64]).all()
    assert (logits[:, 64:] == float("-inf")).all()


@pytest.mark.parametrize("device", DEVICES)
def test_mask_wider_than_logits_ignores_extra_bits(device: str) -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 40, generator=generator).to(device)
    check(logits, random_bitmask(2, 40 + 64, 0.5, generator).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [[3], [0, 6, 2], [7, 6, 5, 4, 3, 2, 1, 0]])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_row_subset_touches_only_named_rows(device: str, rows: list[int], as_tensor: bool) -> None:
    generator = torch.Generator().manual_seed(len(rows))
    logits = torch.randn(8, 300, generator=generator).to(device)
    bitmask = random_bitmask(len(rows), 300, 0.3, generator).to(device)
    expected = expected_after_mask(logits, bitmask, rows)
    apply_token_bitmask_inplace(logits, bitmask, torch.tensor(rows) if as_tensor else rows)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["padded_rows", "every_other_row", "every_other_column", "unaligned"])
def test_non_contiguous_logits(device: str, dtype: torch.dtype, layout: str) -> None:
    generator = torch.Generator().manual_seed(3)
    storage = torch.randn(12, 1200, generator=generator).to(device=device, dtype=dtype)
    logits = {
        "padded_rows": storage[:, :1001],
        "every_other_row": storage[::2, :1000],
        "every_other_column": storage[:, ::2],
        "unaligned": storage[:, 1:1000],
    }[layout]
    untouched = storage.clone()
    bitmask = random_bitmask(logits.shape[0], logits.shape[1], 0.5, generator).to(device)
    check(logits, bitmask)
    # Nothing outside the view changed.
    outside = torch.ones_like(storage, dtype=torch.bool)
    outside_view = {
        "padded_rows": outside[:, :1001],
        "every_other_row": outside[::2, :1000],
        "every_other_column": outside[:, ::2],
        "unaligned": outside[:, 1:1000],
    }[layout]
    outside_view.fill_(False)
    assert torch.equal(storage[outside], untouched[outside])


def test_bitmask_from_llguidance_allows_exactly_the_grammar_tokens() -> None:
    tokenizer = llguidance.LLTokenizer("byte")  # 262 tokens: not a multiple of 32
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex("ab+"))
    bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
    fill_next_token_bitmask(matcher, bitmask, 0)
    logits = torch.zeros(1, 300)  # wider than the tokenizer, as padded model vocabularies are
    apply_token_bitmask_inplace(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == tokenizer.tokenize_str("a")


def test_invalid_arguments_are_rejected() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(logits, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(logits.to(torch.float64), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(IndexError):
        apply_token_bitmask_inplace(logits, torch.zeros(1, 2, dtype=torch.int32), rows=[2])


# ---- GPU only: the sizes of real vocabularies, the CUDA kernel itself, streams ----

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda_only
def test_cuda_kernel_is_built_and_used() -> None:
    assert cuda_kernel_available()


@cuda_only
def test_cuda_prebuilt_kernel_imports_without_the_jit_builder() -> None:
    """What a runtime image without nvcc does with the build that scripts/prebuild_kernels.py left."""
    from llgtrt_core.kernels.cuda_ext import _load_prebuilt, build_directory

    module = _load_prebuilt(build_directory())
    generator = torch.Generator(device="cuda").manual_seed(8)
    logits = torch.randn(8, 1000, generator=generator, device="cuda")
    bitmask = random_bitmask(8, 1000, 0.1, generator)
    expected = expected_after_mask(logits, bitmask, None)
    module.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(logits, expected)


def realistic_bitmask(kind: str, rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return random_bitmask(rows, vocab, 0.5, generator)
    if kind == "nearly_all_masked":  # a JSON state: a few hundred tokens allowed
        return random_bitmask(rows, vocab, 0.003, generator)
    if kind == "nearly_none_masked":  # free text: only a few special tokens disallowed
        return random_bitmask(rows, vocab, 0.999, generator)
    words = (vocab + 31) // 32
    return torch.full((rows, words), 0 if kind == "all_masked" else -1, dtype=torch.int32, device=generator.device)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 49152, 128256, 151936])
@pytest.mark.parametrize("batch", [1, 7, 64, 512])
@pytest.mark.parametrize("kind", ["random", "nearly_all_masked", "nearly_none_masked", "all_masked", "none_masked"])
def test_cuda_real_vocabularies(dtype: torch.dtype, vocab: int, batch: int, kind: str) -> None:
    generator = torch.Generator(device="cuda").manual_seed(batch * vocab)
    logits = torch.randn(batch, vocab, generator=generator, device="cuda", dtype=dtype)
    check(logits, realistic_bitmask(kind, batch, vocab, generator))


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 49152, 128256, 151936])
@pytest.mark.parametrize("allowed_fraction", [0.003, 0.5])
def test_cuda_masked_writes_only_variant(dtype: torch.dtype, vocab: int, allowed_fraction: float) -> None:
    """The variant kept for the benchmark writes disallowed elements one by one."""
    from llgtrt_core.kernels.cuda_ext import load_extension

    generator = torch.Generator(device="cuda").manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=generator, device="cuda", dtype=dtype)
    bitmask = random_bitmask(64, vocab, allowed_fraction, generator)
    expected = expected_after_mask(logits, bitmask, None)
    load_extension().apply_token_bitmask_inplace(logits, bitmask, None, whole_sectors=False)
    assert torch.equal(logits, expected)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 128256, 151936])
@pytest.mark.parametrize("padding", [0, 3, 64])
def test_cuda_row_subsets_of_padded_logits(dtype: torch.dtype, vocab: int, padding: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(vocab + padding)
    storage = torch.randn(300, vocab + padding, generator=generator, device="cuda", dtype=dtype)
    logits = storage[:, :vocab]
    rows = torch.randperm(300, generator=torch.Generator().manual_seed(vocab))[:100].tolist()
    untouched = storage.clone()
    check(logits, random_bitmask(len(rows), vocab, 0.05, generator), rows)
    assert torch.equal(storage[:, vocab:], untouched[:, vocab:])


@cuda_only
def test_cuda_runs_on_the_given_external_stream() -> None:
    generator = torch.Generator(device="cuda").manual_seed(4)
    side = torch.cuda.Stream()
    external = torch.cuda.ExternalStream(side.cuda_stream)
    logits = torch.randn(64, 128256, generator=generator, device="cuda")
    bitmask = random_bitmask(64, 128256, 0.01, generator)
    expected = expected_after_mask(logits, bitmask, None)
    original = logits.clone()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # holds the side stream ~0.1 s
    apply_token_bitmask_inplace(logits, bitmask, stream=external)
    snapshot = logits.clone()  # on the default stream, which the kernel must not be queued on
    torch.cuda.current_stream().synchronize()
    assert torch.equal(snapshot, original)
    external.synchronize()
    assert torch.equal(logits, expected)


@cuda_only
def test_cuda_takes_a_host_bitmask() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 1000, generator=generator).cuda()
    check(logits, random_bitmask(4, 1000, 0.5, generator).pin_memory())
    torch.cuda.synchronize()


# ---- Fused mask + temperature + sample / argmax ----


def masked_argmax_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]]) -> torch.Tensor:
    return expected_after_mask(logits.float(), bitmask, rows).argmax(dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [None, [5, 0, 3]])
def test_fused_greedy_is_masked_argmax(device: str, dtype: torch.dtype, rows: Optional[list[int]]) -> None:
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 5000, generator=generator).to(device=device, dtype=dtype)
    bitmask = random_bitmask(6 if rows is None else len(rows), 5000, 0.02, generator).to(device)
    tokens = sample_with_bitmask(logits, [0.0] * 6, None, bitmask, rows)
    assert torch.equal(tokens, masked_argmax_reference(logits, bitmask, rows))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_sampling_draws_only_allowed_tokens_reproducibly(device: str) -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 3000, generator=generator).to(device)
    bitmask = random_bitmask(64, 3000, 0.01, generator).to(device)
    seeds = torch.arange(64) * 1000 - 7  # negative seeds too
    tokens = sample_with_bitmask(logits, [1.3] * 64, seeds, bitmask)
    allowed = allowed_reference(bitmask, 3000)
    assert allowed.gather(1, tokens[:, None]).all()
    assert torch.equal(tokens, sample_with_bitmask(logits, [1.3] * 64, seeds, bitmask))
    # A row's token depends on its own seed and logits only, not on the rest of the batch.
    alone = sample_with_bitmask(logits[10:11], [1.3], seeds[10:11], bitmask[10:11])
    assert alone.item() == tokens[10].item()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_sampling_follows_softmax_over_allowed_tokens(device: str) -> None:
    rows = 40_000
    row_logits = torch.tensor([1.0, 2.0, 0.0, -1.0, 3.0, 0.5])
    allowed = torch.tensor([True, True, True, True, False, True])  # token 4, the likeliest, is disallowed
    bitmask = torch.full((rows, 1), int(sum(1 << i for i, a in enumerate(allowed) if a)), dtype=torch.int32)
    temperature = 0.7
    tokens = sample_with_bitmask(
        row_logits.repeat(rows, 1).to(device), [temperature] * rows, torch.arange(rows), bitmask.to(device)
    )
    frequencies = torch.bincount(tokens.cpu(), minlength=6).float() / rows
    expected = torch.softmax(torch.where(allowed, row_logits / temperature, float("-inf")), dim=0)
    assert frequencies[4] == 0
    assert torch.allclose(frequencies, expected, atol=0.01)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 128256, 151936])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_cuda_fused_sampling_matches_torch_path(dtype: torch.dtype, vocab: int, batch: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(vocab + batch)
    logits = (4 * torch.randn(batch, vocab, generator=generator, device="cuda")).to(dtype)
    rows = list(range(0, batch, 2))  # every other row constrained
    bitmask = random_bitmask(len(rows), vocab, 0.01, generator)
    temperature = torch.rand(batch, generator=generator, device="cuda") + 0.2
    temperature[::3] = 0.0  # some greedy rows
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=generator, device="cuda")
    tokens = sample_with_bitmask(logits, temperature, seeds, bitmask, rows)
    reference = sample_with_bitmask_torch(logits, temperature, seeds, bitmask, torch.tensor(rows, device="cuda"))
    assert torch.equal(tokens, reference)
