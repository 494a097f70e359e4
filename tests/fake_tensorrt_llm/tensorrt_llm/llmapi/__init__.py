"""FAKE tensorrt_llm.llmapi for adapter unit tests."""

from tensorrt_llm.llmapi.llm import KvCacheConfig

__all__ = ["KvCacheConfig"]
