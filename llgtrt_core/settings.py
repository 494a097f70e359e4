"""Service settings read from the environment (LLGTRT_*), so `bentoml serve` needs no flags."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

DEFAULT_MODEL_TAG = "smollm2-135m-instruct:latest"


@dataclass(frozen=True)
class Settings:
    model_tag: str  # BentoML model store tag to serve
    model_configured: bool  # False: the default tag, which the service packs itself when missing
    served_model_name: Optional[str]  # id clients send as `model`; default: the tag's name
    max_batch_size: int
    max_model_len: Optional[int]
    device: Optional[str]

    @classmethod
    def from_env(cls) -> "Settings":
        tag = os.environ.get("LLGTRT_MODEL")
        max_len = os.environ.get("LLGTRT_MAX_MODEL_LEN")
        return cls(
            model_tag=tag or DEFAULT_MODEL_TAG,
            model_configured=tag is not None,
            served_model_name=os.environ.get("LLGTRT_SERVED_MODEL_NAME"),
            max_batch_size=int(os.environ.get("LLGTRT_MAX_BATCH_SIZE", "8")),
            max_model_len=int(max_len) if max_len else None,
            device=os.environ.get("LLGTRT_DEVICE"),
        )
