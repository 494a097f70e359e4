"""FAKE tensorrt_llm for llgtrt-bento's adapter unit tests: NOT NVIDIA's TensorRT-LLM.

Reproduces the LLM API surface the adapter uses (TensorRT-LLM 1.2 signatures) over a toy CPU
model; see tests/fake_tensorrt_llm/README.md.
"""

from tensorrt_llm.llmapi.llm import LLM, RequestOutput
from tensorrt_llm.sampling_params import SamplingParams

IS_FAKE = True
__version__ = "1.2.0+fake"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "IS_FAKE"]
