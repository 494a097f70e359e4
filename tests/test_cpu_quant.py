"""The CPU's int4 and int8 kernels (llgtrt_core/kernels/cpu_quant.py) against the same arithmetic in
torch: activations quantized to int8 per block of 32; int4 weights scale * q + min with float16
scales, int8 weights times a bfloat16 scale per row."""

from __future__ import annotations

import pytest
import torch

from llgtrt_core.kernels import cpu_quant
from llgtrt_core.layers.quantized_linear import quantize_int4

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="needs AVX-512 VNNI and a C++ compiler")


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: int8 per block of 32, times the block's scale."""
    blocks = x.float().unflatten(-1, (-1, cpu_quant.BLOCK))
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.where(dx > 0, blocks / dx, 0).round() * dx).flatten(-2)  # round half to even, as the kernel


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    weight = q.float() * scales.half().float().repeat_interleave(cpu_quant.BLOCK, 1) \
        + mins.half().float().repeat_interleave(cpu_quant.BLOCK, 1)
    return quantized_x(x) @ weight.t()


@pytest.mark.parametrize("rows", [1, 3, 12])
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (48, 576), (576, 1536)])
def test_int4_mm_matches_its_arithmetic_in_torch(rows: int, out_features: int, in_features: int) -> None:
    torch.manual_seed(rows * out_features + in_features)
    q, scales, mins = quantize_int4(torch.randn(out_features, in_features) * 0.05)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    x[0, :cpu_quant.BLOCK] = 0  # a block of zeros: scale 0
    got = cpu_quant.int4_mm(x, *cpu_quant.pack_int4(q, scales, mins)).float()
    want = reference(x, q, scales, mins)
    assert got.shape == (rows, out_features)
    assert torch.allclose(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max())), float((got - want).abs().max())


def test_int4_mm_takes_a_strided_x_and_rejects_other_dtypes() -> None:
    q, scales, mins = quantize_int4(torch.randn(32, 64))
    packed = cpu_quant.pack_int4(q, scales, mins)
    wide = torch.randn(2, 128).to(torch.bfloat16)
    assert torch.equal(cpu_quant.int4_mm(wide[:, ::2], *packed), cpu_quant.int4_mm(wide[:, ::2].contiguous(), *packed))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_quant.int4_mm(wide[:, :64].float(), *packed)
    with pytest.raises(ValueError, match="64"):
        cpu_quant.int4_mm(wide, *packed)


def test_a_row_group_read_out_of_place_fails_the_comparison() -> None:
    """The packing's rows swapped between two groups: the comparison above must catch it."""
    torch.manual_seed(0)
    q, scales, mins = quantize_int4(torch.randn(32, 64))
    packed, scale_bits, min_bits = cpu_quant.pack_int4(q, scales, mins)
    half = packed.numel() // 2
    swapped = torch.cat([packed[half:], packed[:half]])
    x = torch.randn(1, 64).to(torch.bfloat16)
    got = cpu_quant.int4_mm(x, swapped, scale_bits, min_bits).float()
    want = reference(x, q, scales, mins)
    assert not torch.allclose(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_int8_mm_matches_its_arithmetic_in_torch(rows: int) -> None:
    from llgtrt_core.layers.quantized_linear import quantize_int8

    torch.manual_seed(rows)
    weight, scales = quantize_int8(torch.randn(48, 576))
    scales = scales.to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    got = cpu_quant.int8_mm(x, cpu_quant.pack_int8(weight), scales).float()
    want = quantized_x(x) @ (weight.float() * scales.float()[:, None]).t()
    assert torch.allclose(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max())), float((got - want).abs().max())


def test_helper_threads_compute_every_group_once_and_the_same() -> None:
    """Two threads sharing the chunks (every chunk claimed by whichever gets to it) give the one
    thread's result bit for bit, over many calls (a chunk skipped or run twice would show)."""
    from llgtrt_core.layers.quantized_linear import quantize_int8

    torch.manual_seed(1)
    int4 = cpu_quant.pack_int4(*quantize_int4(torch.randn(3072, 576) * 0.05))
    weight, scales = quantize_int8(torch.randn(4096, 576))
    int8 = (cpu_quant.pack_int8(weight), scales.to(torch.bfloat16))
    xs = [torch.randn(rows, 576).to(torch.bfloat16) for rows in (1, 5)]
    alone = [(cpu_quant.int4_mm(x, *int4), cpu_quant.int8_mm(x, *int8)) for x in xs]
    cpu_quant.set_threads(2)
    try:
        for _ in range(200):
            for x, (want4, want8) in zip(xs, alone):
                assert torch.equal(cpu_quant.int4_mm(x, *int4), want4)
                assert torch.equal(cpu_quant.int8_mm(x, *int8), want8)
    finally:
        cpu_quant.set_threads(1)


def test_two_callers_at_once_each_get_their_own_result() -> None:
    """Two threads calling the kernels at the same time with helpers on (the compile thread warms its
    graphs up while the engine thread serves): each gets its own matmul's result bit for bit. One
    caller at a time shares the chunks with the helpers; with both on one job the helpers ran one
    caller's chunks with the other's weights and the process died (SIGSEGV)."""
    import threading

    from llgtrt_core.layers.quantized_linear import quantize_int8

    torch.manual_seed(2)
    int4 = cpu_quant.pack_int4(*quantize_int4(torch.randn(3072, 576) * 0.05))
    weight, scales = quantize_int8(torch.randn(1536, 1152))
    int8 = (cpu_quant.pack_int8(weight), scales.to(torch.bfloat16))
    calls = [(lambda x: cpu_quant.int4_mm(x, *int4), torch.randn(3, 576).to(torch.bfloat16)),
             (lambda x: cpu_quant.int8_mm(x, *int8), torch.randn(5, 1152).to(torch.bfloat16))]
    alone = [mm(x) for mm, x in calls]
    mismatches = [0, 0]
    start = threading.Barrier(2)

    def caller(index: int) -> None:
        mm, x = calls[index]
        start.wait()
        for _ in range(300):
            mismatches[index] += not torch.equal(mm(x), alone[index])

    cpu_quant.set_threads(2)
    try:
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a caller hung"
    finally:
        cpu_quant.set_threads(1)
    assert mismatches == [0, 0]
