"""The CPU's weight-only int4 and int8 matmuls for a few rows (`csrc/cpu_quant_mm.cpp`, AVX-512
VNNI): builds them (first use, ~10 s, then cached next to the CUDA extension's build), registers
`torch.ops.llgtrt_cpu` and packs weights for them.

Where they cannot run (no AVX-512 VNNI, no C++ compiler) `available()` is False and the quantized
layers keep aten's kernels.
"""

from __future__ import annotations

import functools
import logging

import torch

from llgtrt_core.kernels.cuda_ext import build_directory

logger = logging.getLogger(__name__)

SOURCE = "cpu_quant_mm.cpp"
LIBRARY = "llgtrt_cpu"
ROWS_PER_GROUP = 16  # output rows the kernel computes at once: one AVX-512 lane each
BLOCK = 32  # input channels per scale and minimum (llama.cpp's Q4_1 block)
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma"]


@functools.cache
def available() -> bool:
    """Whether the kernels run here: the CPU has AVX-512 VNNI and the library builds and loads."""
    if not (torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()):
        return False
    from pathlib import Path

    from torch.utils.cpp_extension import load

    build_dir = build_directory() / "cpu"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        load(name="llgtrt_cpu_quant", sources=[str(Path(__file__).parent / "csrc" / SOURCE)],
             build_directory=str(build_dir), extra_cflags=FLAGS, is_python_module=False)
    except Exception:  # no compiler, a build error: compiler and linker failures come as several types
        logger.exception("building the cpu quantized matmuls failed; quantized layers use aten's kernels")
        return False

    @torch.library.register_fake(f"{LIBRARY}::int4_mm")
    def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], scales.numel() * BLOCK // x.shape[1])

    @torch.library.register_fake(f"{LIBRARY}::int8_mm")
    def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], scales.numel())

    return True


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (out, in) 0..15, scales and mins (out, in / BLOCK), weight = scale * q + min, into the
    kernel's layout: per group of 16 output rows and block of 32 inputs, 4 x 64 bytes whose low
    and high nibbles are 8 vectors of [row 0..15] x [4 consecutive inputs], and the group's 16
    scales and 16 mins of that block as float16 (their bits, as int16)."""
    out_features, in_features = q.shape
    groups, blocks = out_features // ROWS_PER_GROUP, in_features // BLOCK
    # in = 8c + 4h + t within a block: chunk c's low nibbles (h 0) and high nibbles (h 1), input t of 4
    nibbles = q.to(torch.uint8).view(groups, ROWS_PER_GROUP, blocks, 4, 2, 4)
    packed = _lanes_by_row(nibbles[..., 0, :] | (nibbles[..., 1, :] << 4))

    def per_group(values: torch.Tensor) -> torch.Tensor:  # float16's bits: a model's .to(dtype) leaves them be
        return values.to(torch.float16).view(groups, ROWS_PER_GROUP, blocks).transpose(1, 2).contiguous().view(torch.int16)

    return packed, per_group(scales), per_group(mins)


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) int8 into the kernel's layout: per group of 16 output rows and block of 32
    inputs, 8 vectors of [row 0..15] x [4 consecutive inputs], each weight plus 128 (unsigned)."""
    out_features, in_features = weight.shape
    shifted = (weight.to(torch.int16) + 128).to(torch.uint8)
    return _lanes_by_row(shifted.view(out_features // ROWS_PER_GROUP, ROWS_PER_GROUP, in_features // BLOCK, 8, 4))


def _lanes_by_row(values: torch.Tensor) -> torch.Tensor:
    """(group, row, block, vector, 4 bytes) -> flat (group, block, vector, row, 4 bytes)."""
    return values.permute(0, 2, 3, 1, 4).contiguous().view(-1)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x (rows, in) bfloat16 @ the packed weight's transpose, in bfloat16. x is quantized to int8
    per block of 32 (as llama.cpp's Q8_1) for the integer dot products."""
    _check_x(x, scales.shape[1] * BLOCK)  # scales: (groups, blocks, 16)
    return torch.ops.llgtrt_cpu.int4_mm(x, packed, scales, mins)


def _check_x(x: torch.Tensor, in_features: int) -> None:
    """The kernels' own checks, raised here: an exception thrown out of the extension crashed the
    process on the GPU machine's torch build (2.11)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != in_features:
        raise ValueError(f"x must be (rows, {in_features}) bfloat16, not {tuple(x.shape)} {x.dtype}")


def int8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (rows, in) bfloat16 @ (the packed int8 weight * scales (out,) bfloat16)'s transpose, in
    bfloat16, x quantized as for `int4_mm`."""
    _check_x(x, packed.numel() // scales.numel())
    return torch.ops.llgtrt_cpu.int8_mm(x, packed, scales)


def set_threads(threads: int) -> None:
    """Threads that share the kernels' work from now on (the caller and threads - 1 helpers)."""
    torch.ops.llgtrt_cpu.set_threads(threads)
