"""FAKE tensorrt_llm.sampling_params: the fields, defaults and checks of TensorRT-LLM 1.2's
SamplingParams that the adapter touches, and the two logits-processor base classes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List, Optional, Union

import torch


class LogitsProcessor(ABC):
    @abstractmethod
    def __call__(self, req_id: int, logits: torch.Tensor, token_ids: List[List[int]],
                 stream_ptr: Optional[int], client_id: Optional[int]) -> None: ...


class BatchedLogitsProcessor(ABC):
    @abstractmethod
    def __call__(self, req_ids: List[int], logits: List[torch.Tensor], token_ids: List[List[List[int]]],
                 stream_ptr: int, client_ids: List[Optional[int]]) -> None: ...


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    logits_processor: Optional[Union[LogitsProcessor, List[LogitsProcessor]]] = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    min_p: Optional[float] = None
    ignore_eos: bool = False
    detokenize: bool = True

    def __post_init__(self):
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")

    @property
    def _greedy_decoding(self) -> bool:
        """1.x: greedy when temperature is 0, top_k is 1, or top_k, top_p and temperature are all
        unset (older releases ignored the temperature here)."""
        if self.use_beam_search:
            return False
        if self.temperature == 0 or self.top_k == 1:
            return True
        return self.top_k is None and self.top_p is None and self.temperature is None
