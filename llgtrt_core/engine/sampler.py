"""Batched sampling: greedy, temperature, top-k, top-p, and per-request seeded generators.

Each row draws its randomness from its own generator, so a seeded request samples the same
tokens whatever else shares its batch. Sampling uses the exponential race
(argmax of p / Exp(1)), equivalent to a categorical draw and free of a cumulative-sum search.
"""

from __future__ import annotations

from typing import Sequence

import torch

from llgtrt_core.engine.interface import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf. top_k 0 = off, top_p 1 = off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass before it is below top_p (the top token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """logits: (n, vocab) float32, already constrained. Returns the sampled token ids (n,)."""
    greedy_tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return greedy_tokens
    device = logits.device
    rows = torch.tensor(random_rows, device=device)
    temperature = torch.tensor([params[i].temperature for i in random_rows], device=device)
    scaled = logits[rows] / temperature.unsqueeze(1)
    if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in random_rows):
        top_k = torch.tensor([params[i].top_k for i in random_rows], device=device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=device)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        noise[j].exponential_(generator=generators[i])
    # A zero draw would turn a masked (p = 0) token into 0/0 = nan: keep noise positive.
    sampled = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return greedy_tokens.index_copy(0, rows, sampled)
