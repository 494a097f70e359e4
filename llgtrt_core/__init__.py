"""llgtrt-bento: an OpenAI-compatible LLM server with guaranteed structured output."""

__version__ = "0.1.0"
