"""Build the CUDA mask kernel ahead of time (e.g. while the image is built), so that a
container loads it at start instead of compiling it on the first request.

    python scripts/prebuild_kernels.py [--build-dir DIR] [--arch-list "8.0;8.6;8.9;9.0+PTX"]

Run it where nvcc exists; no GPU is needed. A server finds the result in the same default
directory, or in DIR when LLGTRT_KERNEL_BUILD_DIR=DIR is set for it too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Ampere, Ada and Hopper machine code, plus PTX that newer GPUs compile at load.
DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0+PTX"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-dir", type=Path, help="default: $LLGTRT_KERNEL_BUILD_DIR or ~/.cache/llgtrt/...")
    parser.add_argument("--arch-list", help=f"TORCH_CUDA_ARCH_LIST (default: the GPU, else {DEFAULT_ARCH_LIST})")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.build_dir:
        os.environ["LLGTRT_KERNEL_BUILD_DIR"] = str(args.build_dir)
    if args.arch_list:
        os.environ["TORCH_CUDA_ARCH_LIST"] = args.arch_list

    import torch

    if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST

    from llgtrt_core.kernels.cuda_ext import KernelUnavailable, build_directory, load_extension

    try:
        load_extension()
    except KernelUnavailable as error:
        sys.exit(f"prebuild failed: {error}")
    print(f"CUDA mask kernel ready in {build_directory()}")


if __name__ == "__main__":
    main()
