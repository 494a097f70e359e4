"""FAKE tensorrt_llm.executor for adapter unit tests."""
