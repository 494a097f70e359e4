"""Each Triton op of llgtrt_core/layers against its plain torch twin (the reference).

On CUDA: float32 and bfloat16, real shapes. Without CUDA, the last test reruns this file in a
subprocess under TRITON_INTERPRET=1, which runs the kernels on CPU tensors in numpy: tiny
shapes and float32 only there (the interpreter rounds float32 to bfloat16 toward zero and
multiplies bfloat16 `tl.dot` operands as their raw bits, so bfloat16 is checked on CUDA only).
The KV cache is paged as in the engine (`llgtrt_core.engine.kv_cache`), each row's blocks
shuffled across the pool. Cache positions a kernel must not read hold NaN, and on CUDA the
allocator's free blocks are filled with NaN first, so outputs a kernel fails to write show up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec

import pytest
import torch

from llgtrt_core.layers import activation, attention, layernorm, linear, rotary

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    DEVICE, DTYPES, BATCHES, HIDDENS = "cpu", [torch.float32], [1, 3], [96]
    HEAD_DIMS, KV_HEADS, LENGTHS, CAPACITY = [32, 48], 2, [1, 17, 70], 80  # 48: masked dims
else:
    DEVICE, DTYPES, BATCHES, HIDDENS = "cuda", [torch.float32, torch.bfloat16], [1, 3, 64], [576, 4096]
    HEAD_DIMS, KV_HEADS, LENGTHS, CAPACITY = [64, 128], 8, [1, 17, 300, 1000], 1024
GROUPS = [1, 4]
BLOCK_SIZE = 16

kernels = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or the interpreter")


def triton_ops():
    from llgtrt_core.layers import activation_triton, attention_triton, layernorm_triton, linear_triton, rotary_triton

    return activation_triton, attention_triton, layernorm_triton, rotary_triton, linear_triton


def poison_allocator() -> None:
    """Leave NaN in freed blocks of the caching allocator, where the ops' outputs will come from."""
    if DEVICE == "cuda":
        for size in (1 << 16, 1 << 20, 1 << 26):
            torch.full((size,), float("nan"), device=DEVICE)  # freed at once, its block keeps the NaN


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.bfloat16:
        relative = (actual.float() - expected.float()).norm() / expected.float().norm()
        assert relative < 2e-2, float(relative)
    else:
        torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)


def paged_table(rows: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, CAPACITY / BLOCK_SIZE) block ids: every row its own blocks, in shuffled order, from
    a pool whose block 0 (the scratch block) nobody owns."""
    per_row = CAPACITY // BLOCK_SIZE
    return (torch.randperm(rows * per_row, generator=generator, device=DEVICE) + 1).view(rows, per_row)


def to_pages(per_row: torch.Tensor, table: torch.Tensor, scratch: float) -> torch.Tensor:
    """A cache laid out (rows, kv_heads, CAPACITY, head_dim), stored in the blocks `table` lists;
    the scratch block holds `scratch`."""
    rows, kv_heads, _, head_dim = per_row.shape
    tiles = per_row.view(rows, kv_heads, -1, BLOCK_SIZE, head_dim).transpose(1, 2).flatten(0, 1)
    paged = per_row.new_full((rows * table.shape[1] + 1, kv_heads, BLOCK_SIZE, head_dim), scratch)
    paged[table.flatten()] = tiles
    return paged


def rope_tables(head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).repeat(1, 2)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", BATCHES)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype: torch.dtype, rows: int, hidden: int, with_residual: bool) -> None:
    generator = torch.Generator(DEVICE).manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=generator, device=DEVICE, dtype=dtype)
    residual = torch.randn(rows, hidden, generator=generator, device=DEVICE, dtype=dtype) if with_residual else None
    weight = torch.rand(hidden, generator=generator, device=DEVICE, dtype=dtype) + 0.5
    expected_out, expected_stream = layernorm.add_rms_norm(x.clone(), None if residual is None else residual.clone(),
                                                           weight, 1e-5)
    poison_allocator()
    out, stream = triton_ops()[2].add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(out, expected_out)
    torch.testing.assert_close(stream, expected_stream, rtol=0, atol=0)  # the same rounding of the same add
    if with_residual:
        assert stream is residual  # written back in place
    else:
        assert stream is x


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", BATCHES)
@pytest.mark.parametrize("size", [100, 1024, 14336] if DEVICE == "cuda" else [100])
def test_silu_mul(dtype: torch.dtype, rows: int, size: int) -> None:
    generator = torch.Generator(DEVICE).manual_seed(size)
    gate_up = 3 * torch.randn(rows, 2 * size, generator=generator, device=DEVICE, dtype=dtype)
    poison_allocator()
    assert_matches(triton_ops()[0].silu_mul(gate_up), activation.silu_mul(gate_up))


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv(dtype: torch.dtype, batch: int, head_dim: int, group: int, qk_norm: bool) -> None:
    heads = KV_HEADS * group
    generator = torch.Generator(DEVICE).manual_seed(batch * head_dim + group)
    qkv = torch.randn(batch, (heads + 2 * KV_HEADS) * head_dim, generator=generator, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, CAPACITY, (batch,), generator=generator, device=DEVICE)
    cos, sin = rope_tables(head_dim, CAPACITY)
    norms = ()
    if qk_norm:
        norms = tuple(torch.rand(head_dim, generator=generator, device=DEVICE, dtype=dtype) + 0.5 for _ in range(2))
        norms += (1e-6,)
    table = paged_table(batch, generator)
    cache_shape = (table.numel() + 1, KV_HEADS, BLOCK_SIZE, head_dim)
    keys, values = (torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_q = rotary.rope_write_kv(qkv, positions, cos, sin, expected_keys, expected_values, table, *norms)
    poison_allocator()
    q = triton_ops()[3].rope_write_kv(qkv, positions, cos, sin, keys, values, table, *norms)
    assert_matches(q, expected_q)
    blocks = table[torch.arange(batch, device=DEVICE), positions // BLOCK_SIZE]
    offsets = positions % BLOCK_SIZE
    assert_matches(keys[blocks, :, offsets], expected_keys[blocks, :, offsets])
    assert torch.equal(values[blocks, :, offsets], expected_values[blocks, :, offsets])  # copied as is
    for cache in (keys, values):  # nothing else written
        cache[blocks, :, offsets] = float("nan")
        assert cache.isnan().all()


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("length", LENGTHS)
def test_decode_attention(dtype: torch.dtype, batch: int, head_dim: int, group: int, length: int) -> None:
    """Row 0 attends over `length` keys, the others over random shorter lengths."""
    heads = KV_HEADS * group
    generator = torch.Generator(DEVICE).manual_seed(batch * length + head_dim + group)
    positions = torch.randint(0, length, (batch,), generator=generator, device=DEVICE)
    positions[0] = length - 1
    q = torch.randn(batch, heads, head_dim, generator=generator, device=DEVICE, dtype=dtype)
    cache_shape = (batch, KV_HEADS, CAPACITY, head_dim)
    keys, values = (torch.randn(cache_shape, generator=generator, device=DEVICE, dtype=dtype) for _ in range(2))
    beyond = (torch.arange(CAPACITY, device=DEVICE) > positions[:, None])[:, None, :, None]  # (rows, 1, capacity, 1)
    table = paged_table(batch, generator)
    clean_keys, clean_values = (to_pages(t.masked_fill(beyond, 0.0), table, 0.0) for t in (keys, values))
    poisoned_keys, poisoned_values = (to_pages(t.masked_fill(beyond, float("nan")), table, float("nan"))
                                      for t in (keys, values))
    expected = attention.decode_attention(q, clean_keys, clean_values, table, positions, length)
    poison_allocator()
    got = triton_ops()[1].decode_attention(q, poisoned_keys, poisoned_values, table, positions, length)
    assert not got.isnan().any()
    assert_matches(got, expected)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("out_features, in_features", [(93, 100), (6, 256), (200, 100)] if DEVICE == "cpu" else
                         [(93, 100), (4096, 4096), (4096, 14336), (6144, 4096)])  # ragged blocks, even ones, wide
@pytest.mark.parametrize("bias", [False, True])
def test_linear(dtype: torch.dtype, rows: int, out_features: int, in_features: int, bias: bool) -> None:
    generator = torch.Generator(DEVICE).manual_seed(out_features * in_features + rows)
    module = torch.nn.Linear(in_features, out_features, bias=bias, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(out_features, in_features, generator=generator, device=DEVICE) / 32)
        if bias:
            module.bias.copy_(torch.randn(out_features, generator=generator, device=DEVICE))
    x = torch.randn(rows, in_features, generator=generator, device=DEVICE, dtype=dtype)
    linear_triton = triton_ops()[4]
    # More rows or outputs than inputs: the module's own matmul.
    assert linear_triton.runs_as_gemv(module, x) == (rows == 1 and out_features <= in_features)
    poison_allocator()
    got = linear_triton.linear(module, x)
    assert not got.isnan().any()
    assert_matches(got, linear.linear(module, x))
    if rows == 1:  # a vector too (the lm_head of one position is projected as one)
        assert_matches(linear_triton.linear(module, x[0]), linear.linear(module, x[0]))


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available() or find_spec("triton") is None,
                    reason="runs the kernels on CPU under the interpreter: needs triton, not needed with CUDA")
def test_kernels_under_the_cpu_interpreter() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
