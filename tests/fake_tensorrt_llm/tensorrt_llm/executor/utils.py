"""FAKE tensorrt_llm.executor.utils: the error type TensorRT-LLM's results raise."""


class RequestError(RuntimeError):
    """As tensorrt_llm.executor.utils.RequestError: a request the executor refused or failed."""
