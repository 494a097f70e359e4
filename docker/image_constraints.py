"""Constraints for installing the service into NVIDIA's TensorRT-LLM release image.

Reads the image's `pip list --format=freeze` on stdin and writes a pip constraints file that pins
only what TensorRT-LLM's kernels and our adapter depend on at binary level (the torch and CUDA
stack, TensorRT and TensorRT-LLM themselves, transformers/tokenizers, numpy, pydantic), so pip
fails rather than replace them. Everything else may move to what requirements.trtllm.txt asks
for: the image pins llguidance 0.7.x and a fastapi 0.12x (with its starlette) that ours replace,
which only TensorRT-LLM's own server (trtllm-serve) and its built-in guided decoding use.
Run by docker/trtllm.Dockerfile.j2; stdlib only.
"""

from __future__ import annotations

import re
import sys

PROTECTED = re.compile(
    r"^(torch|torchvision|torchaudio|triton|tensorrt|tensorrt[-_].*|nvidia[-_].*|cuda[-_].*|flashinfer[-_]python|"
    r"transformers|tokenizers|safetensors|numpy|mpi4py|pydantic|pydantic[-_]core)$"
)
PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def constraints(freeze: str) -> list[str]:
    """The `name==version` lines of a freeze listing whose package is protected."""
    kept = []
    for line in freeze.splitlines():
        match = PINNED.match(line.strip())
        if match and PROTECTED.match(match.group(1).lower()):
            kept.append(line.strip())
    return kept


if __name__ == "__main__":
    sys.stdout.write("".join(f"{line}\n" for line in constraints(sys.stdin.read())))
