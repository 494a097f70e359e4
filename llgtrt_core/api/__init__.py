"""The OpenAI-compatible HTTP surface (FastAPI), mounted at /v1 by the service."""
