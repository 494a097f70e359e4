"""The TensorRT-LLM image build installs our requirements on top of NVIDIA's release image
without replacing its torch stack, and without pins pip cannot resolve against ours.

No docker here: this checks the constraints docker/trtllm.Dockerfile.j2 feeds pip, computed by
the same script, from the release image's package pins as TensorRT-LLM 1.2's requirements.txt
sets them (an excerpt; the real image's `pip list` is what the build reads)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "docker" / "image_constraints.py"

# tensorrt_llm 1.2's requirements.txt pins, as the image's freeze lists them (excerpt)
IMAGE_FREEZE = """\
tensorrt_llm==1.2.1
tensorrt==10.13.3.9
torch==2.9.0a0+145a3a7bda.nv25.10
triton==3.5.0
nvidia-nccl-cu13==2.27.7
flashinfer-python==0.6.0
transformers==4.57.1
tokenizers==0.22.1
numpy==1.26.4
pydantic==2.12.4
pydantic_core==2.41.5
llguidance==0.7.29
xgrammar==0.1.25
fastapi==0.121.3
starlette==0.49.3
jinja2==3.1.4
mpi4py==4.1.1
etcd3 @ git+https://github.com/kragniz/python-etcd3.git@e58a899579ba416449c4e225b61f039457c8072a
"""


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9._-]+)==(\S+)$", line.strip())
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def _constraints() -> str:
    return subprocess.run([sys.executable, str(SCRIPT)], input=IMAGE_FREEZE, capture_output=True, text=True,
                          check=True).stdout


def test_the_image_build_pins_the_torch_stack_and_leaves_our_requirements_free():
    constrained = _pins(_constraints())
    ours = _pins((REPO_ROOT / "requirements.trtllm.txt").read_text())
    clashes = {name: (version, constrained[name]) for name, version in ours.items()
               if name in constrained and constrained[name] != version}
    assert clashes == {}  # pip could not resolve these
    for kept in ("tensorrt-llm", "tensorrt", "torch", "triton", "nvidia-nccl-cu13", "transformers", "tokenizers",
                 "numpy", "pydantic", "pydantic-core", "mpi4py", "flashinfer-python"):
        assert kept in constrained, kept
    assert not {"llguidance", "fastapi", "starlette", "etcd3"} & set(constrained)


def test_the_dockerfile_template_installs_with_those_constraints():
    template = (REPO_ROOT / "docker" / "trtllm.Dockerfile.j2").read_text()
    assert "image_constraints.py > /tmp/image-constraints.txt" in template
    assert "-c /tmp/image-constraints.txt -r ./env/python/requirements.txt" in template
    bentofile = (REPO_ROOT / "bentofile.trtllm.yaml").read_text()
    assert "- docker/image_constraints.py" in bentofile  # the template copies it from the Bento's src
