"""FAKE tensorrt_llm._tensorrt_engine (TensorRT engine backend) for adapter unit tests."""

from tensorrt_llm.llmapi.llm import _TrtLLM as LLM

__all__ = ["LLM"]
