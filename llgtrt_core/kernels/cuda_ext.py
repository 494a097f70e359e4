"""Builds (first use, then cached) and loads the CUDA extension in `csrc/`.

The build goes through torch's JIT extension builder into a per-torch-version directory, so a
directory prebuilt into an image (`scripts/prebuild_kernels.py`) is found and loaded without
compiling, and imported directly where the image has no nvcc. `LLGTRT_KERNEL_BUILD_DIR`
overrides the location.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

EXTENSION_NAME = "llgtrt_token_bitmask"
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("bindings.cpp", "token_bitmask.cu", "masked_sampling.cu")]


class KernelUnavailable(RuntimeError):
    """The CUDA extension cannot be built or loaded here (no CUDA torch, no nvcc, build error)."""


def build_directory() -> Path:
    configured = os.environ.get("LLGTRT_KERNEL_BUILD_DIR")
    if configured:
        return Path(configured)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "llgtrt" / "kernels" / f"torch{torch.__version__}".replace("+", "_")


def _nvcc_path() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.cache
def load_extension() -> ModuleType:
    """The compiled module; raises `KernelUnavailable` with the reason when it cannot exist."""
    if torch.version.cuda is None:
        raise KernelUnavailable(f"torch {torch.__version__} is built without CUDA")
    build_dir = build_directory()
    if _nvcc_path() is None:
        return _load_prebuilt(build_dir)
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    cached = any(build_dir.glob(f"{EXTENSION_NAME}*.so"))
    logger.info(
        "%s CUDA mask kernel %s in %s",
        "loading" if cached else "building (about a minute, once)",
        EXTENSION_NAME,
        build_dir,
    )
    try:
        return load(
            name=EXTENSION_NAME,
            sources=[str(path) for path in SOURCES],
            build_directory=str(build_dir),
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )
    except Exception as error:  # compiler / linker failures come as several exception types
        raise KernelUnavailable(f"building the CUDA mask kernel failed: {error}") from error


def _load_prebuilt(build_dir: Path) -> ModuleType:
    """Without nvcc (a runtime image), import the newest build left by scripts/prebuild_kernels.py."""
    builds = sorted(build_dir.glob(f"{EXTENSION_NAME}*.so"), key=lambda path: path.stat().st_mtime)
    if not builds:
        raise KernelUnavailable(
            f"nvcc not found and no prebuilt kernel in {build_dir}: install the CUDA toolkit or set "
            "CUDA_HOME, or prebuild with scripts/prebuild_kernels.py where nvcc exists"
        )
    path = builds[-1]
    logger.info("nvcc not found: loading prebuilt CUDA mask kernel %s", path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
