"""The decode step under CUDA graphs: one launch per step instead of a few hundred kernels.

A graph fixes its shapes, so steps are padded to a bucket of rows: the next size in 1, 2, 4, 8,
16, 32, 48, 64, ... (steps of 32 past 256). Key lengths need no bucket: the decode ops read each
row's length (its position + 1) on the device, so one graph per bucket serves every length.

A row is a token at a position of one cache row's sequence: its key and value are written there,
and it attends to that sequence's keys up to its position. Nothing else sets a decode row apart
from a prompt token, so a prompt's tokens can ride as rows too, each with its own position and
its sequence's blocks: the ops write every row's keys before any row attends, so a prompt token
sees the tokens before it in the same pass. The buckets therefore go past the cache's rows, by
`PROMPT_ROWS`: a step that decodes every running row and prefills a short prompt is one replay.
(Attention per row reads all of the row's keys, so a prompt of L tokens reads ~L^2/2 keys:
cheap for the short prompts this is for, not for long ones, which the eager pass computes with
SDPA.)

The graph reads its own copy of the block table rows, refreshed each step: padding rows feed token
0 at position 0 with a table row of scratch blocks (`kv_cache.SCRATCH_BLOCK`), which no sequence
owns, so padding changes nothing a sequence reads. Every bucket's graph is captured up front,
when this is built, and they share one memory pool.
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch

from llgtrt_core.engine.kv_cache import SCRATCH_BLOCK, KVCache
from llgtrt_core.models.llama import LlamaForCausalLM


PROMPT_ROWS = 256  # rows past the cache's slots: prompt tokens riding in a decode step


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, min(max_batch, 256) + 1, 16)) + list(range(288, max_batch + 1, 32))
    return sorted({size for size in sizes if size < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache):
        if cache.growable:
            raise ValueError("CUDA graphs need a KV cache allocated up front (KVCache.for_device)")
        self.model = model
        self.cache = cache
        self.max_rows = cache.num_slots + PROMPT_ROWS
        self.buckets = batch_buckets(self.max_rows)
        device = cache.keys[0].device
        self.token_ids = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        self.block_table = torch.full((self.max_rows, cache.block_table.shape[1]), SCRATCH_BLOCK,
                                      dtype=cache.block_table.dtype, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # by batch bucket
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor,
               cache_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """LlamaForCausalLM.decode of n <= max_rows rows, without its key_len: the graph's bound is
        the whole context (see _capture). Row i is token_ids[i] at positions[i] of the sequence in
        cache row cache_rows[i] (default: row i). Returns logits (n, vocab)."""
        n = token_ids.shape[0]
        batch = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.token_ids[:n].copy_(token_ids)
        self.positions[:n].copy_(positions)
        if cache_rows is None:
            self.block_table[:n].copy_(self.cache.block_table[:n])
        else:
            torch.index_select(self.cache.block_table, 0, cache_rows, out=self.block_table[:n])
        self.token_ids[n:batch].zero_()
        self.positions[n:batch].zero_()
        self.block_table[n:batch].fill_(SCRATCH_BLOCK)
        graph, logits = self.graphs[batch]
        graph.replay()
        return logits[:n]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every bucket, largest first (the shared pool is sized by the largest), with padding
        inputs only, so no sequence's keys are touched. Captured lazily, each size a shrinking batch
        reached for the first time stalled every running row (constrained rows, which end at different
        steps, saw gaps of 0.3 s at 256 streams; docs/benchmarks/engine.md)."""
        self.token_ids.zero_()
        self.positions.zero_()
        self.block_table.fill_(SCRATCH_BLOCK)
        for batch in reversed(self.buckets):
            self.graphs[batch] = self._capture(batch)

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run the step once eagerly (compiles the Triton kernels, warms up the allocator), then
        record it. The key bound is the context length, right for every step the graph replays
        (the Triton ops ignore it; the torch ops, used without triton, mask over it).

        The static inputs already hold this step's real tokens, so the eager run and the
        replay that follows write the same keys and values: capturing changes no state.
        """
        token_ids, positions, block_table = self.token_ids[:batch], self.positions[:batch], self.block_table[:batch]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.decode(token_ids, positions, self.cache.max_len, self.cache, block_table)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.decode(token_ids, positions, self.cache.max_len, self.cache, block_table)
        return graph, logits
