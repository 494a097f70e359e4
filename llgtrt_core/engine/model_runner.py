"""The embedded engine's forward pass: a step plan in, the logits of every row that samples out.

A step decodes one token for each running row (CUDA graphs when captured, `decode_graphs.py`),
feeds the tokens a grammar forced after the last sampled one (`extend_batch`), and prefills the
plan's prompt chunks, several per pass. When rows decode and prompts are prefilled in the same
step and nothing was queued ahead, both go through one `mixed` pass: the weights are read once,
not once for the decode and again for the prompts.

Under CUDA graphs, short prompt chunks (`GRAPH_CHUNK_TOKENS`) are computed by the decode graphs
too, each token a row of its own (see decode_graphs.py): an eager pass costs ~0.6 ms of host
time per layer in kernel launches, 20 ms for an 8B model whatever its size, where a replay costs
the GPU's time alone. A mixed step is then a single replay. Longer chunks run eagerly (SDPA).

On the CPU, once the decode step is compiled (compiled_decode.py), prompt chunks as short as
its graphs' rows ride it the same way: an eager pass pays ~25 torch ops a layer dispatched from
Python (docs/benchmarks/cpu.md), where the compiled step is one call.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Optional

import torch

from llgtrt_core.engine.compiled_decode import CompiledDecode
from llgtrt_core.engine.decode_graphs import DecodeGraphs
from llgtrt_core.engine.kernel_threads import KernelThreads
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.sampler import token_logprobs
from llgtrt_core.engine.sequence import Chunk, Sequence, StepPlan
from llgtrt_core.kernels import int64_to_device
from llgtrt_core.models.llama import LayersDecode, LlamaForCausalLM, Segment

_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions projected to the vocabulary at once
PREFILL_PASS_TOKENS = 8192  # prompt tokens batched into one forward pass (bounds its activations)
GRAPH_CHUNK_TOKENS = 128  # a prompt chunk up to this long is computed by the decode graphs
# On the CPU each riding token's row gathers all its sequence's keys (eager attention reads them
# once): a chunk rides while rows x keys stay below this (measured paying: 12 rows over 44 keys).
CPU_RIDE_KEYS = 1024


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device,
                 decode_graphs: Optional[DecodeGraphs], mixed_prefill: bool = True,
                 compiled_decode: Optional[CompiledDecode] = None, kernel_threads: Optional[KernelThreads] = None):
        self.model = model
        self.compiled_decode = compiled_decode
        self.kernel_threads = kernel_threads
        self.mixed_prefill = mixed_prefill
        self.cache = cache
        self.device = device
        self.decode_graphs = decode_graphs
        self.num_mixed_steps = 0  # steps that decoded and prefilled in one pass
        # Rows the last step that decoded decoded: a prompt step after more streams than one finds
        # their API process busy (ending them, taking the next requests), no core to spare.
        self._last_decoded = 0
        # The compiled CPU decode step, read once a step (its compile finishes on another thread).
        self._step_layers: Optional[LayersDecode] = None
        # Block table rows of a compiled pass with prompt rows: a normal tensor, sliced, as the
        # cache's own table is (compiled graphs are specific to the kind of tensor, and guard on a
        # view's base).
        self._ride_table = None if compiled_decode is None else torch.zeros(
            compiled_decode.max_rows, cache.block_table.shape[1], dtype=cache.block_table.dtype, device=device)

    def forward(self, plan: StepPlan, running: list[Sequence], ahead: Optional[torch.Tensor]
                ) -> Optional[torch.Tensor]:
        """Run `plan` over the running rows; `ahead`: the logits of their decode queued ahead (fed the
        sampled tokens on the device), None to decode here. The logits of every row that samples
        this step, in row order (None when no row does). Advances each sequence's cached length."""
        logits = []
        num_decoding = plan.num_decoding
        self._step_layers = None if self.compiled_decode is None else self.compiled_decode.layers_decode()
        if self.kernel_threads is not None:
            self.kernel_threads.before_step()
        if num_decoding:
            batch = running[:num_decoding]
            self._last_decoded = num_decoding
            if ahead is None and self._mixes(batch, plan.chunks):
                return self._mixed(batch, plan.chunks)
            if ahead is None:
                ahead = self.decode(batch, int64_to_device([seq.pending_tokens[0] for seq in batch], self.device))
                for seq in batch:
                    seq.length += 1
                    seq.pending_tokens = seq.pending_tokens[1:]  # a copy: the list went out in a delta
            decoded = self._extend_pending(batch, ahead[:num_decoding])
            if self.decode_graphs is not None and any(map(self._rides_graph, plan.chunks)):
                # The graphs share one memory pool: the prefill's replay would overwrite these logits.
                decoded = decoded.clone()
            logits.append(decoded)
        if plan.chunks:
            rows = self._prefill(plan.chunks)
            # Only the last chunk can stop short of its prompt's end (the scheduler stops there).
            sampling = rows if plan.chunks[-1].last else rows[:-1]
            if sampling.shape[0]:
                logits.append(sampling)
        if not logits:
            return None
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def decode(self, batch: list[Sequence], token_ids: torch.Tensor,
               chunks: Optional[list[Chunk]] = None) -> torch.Tensor:
        """One batched decode of `token_ids` (on the device) at each sequence's next position (rows
        0..n-1, their blocks allocated); the caller advances the lengths. `chunks` (whole prompts
        that ride the graphs, `ride_room`) are prefilled in the same replay: their last logits
        follow the decoded rows', and their sequences' lengths are advanced here."""
        if chunks:
            self.num_mixed_steps += 1
            logits = self._graph_pass(batch, chunks, token_ids)
            for chunk in chunks:
                chunk.seq.length = chunk.end
            return logits
        positions = [seq.length for seq in batch]
        positions_tensor = int64_to_device(positions, self.device)
        if self.decode_graphs is not None:
            return self.decode_graphs.decode(token_ids, positions_tensor)
        layers_decode = None if self.compiled_decode is None else self.compiled_decode.layers_decode()
        with self.compiled_decode.stance() if layers_decode is not None else contextlib.nullcontext():
            return self.model.decode(token_ids, positions_tensor, max(positions) + 1, self.cache,
                                     self.cache.block_table[: len(batch)], layers_decode)

    def _mixes(self, batch: list[Sequence], chunks: list[Chunk]) -> bool:
        """Decode and prefill share one pass: there are prompts, none scores its logprobs (that pass
        projects every position), no row has grammar-forced tokens to feed besides its decode token,
        and the prompts fit one pass: under graphs, one replay (eagerly, the launches would cost
        more than a second read of the weights)."""
        if not (self.mixed_prefill and chunks and all(len(seq.pending_tokens) == 1 for seq in batch)):
            return False
        if self._rides_together(batch, chunks):
            return True
        return (self.decode_graphs is None and not any(c.seq.scores_prompt() for c in chunks)
                and sum(c.num_tokens for c in chunks) <= PREFILL_PASS_TOKENS)

    def _rides_together(self, batch: list[Sequence], chunks: list[Chunk]) -> bool:
        """The decode of `batch` and every prompt chunk fit one pass of the graphs (compiled step)."""
        return (all(self._rides_graph(c) for c in chunks)
                and len(batch) + sum(c.num_tokens for c in chunks) <= self._graph_rows())

    def ride_room(self, num_decoding: int) -> tuple[int, int]:
        """Prompt tokens that can ride in a decode of `num_decoding` rows: in all, and per chunk
        (none without graphs)."""
        if self.decode_graphs is None or not self.mixed_prefill:
            return 0, 0
        return self.decode_graphs.max_rows - num_decoding, GRAPH_CHUNK_TOKENS

    def _rides_graph(self, chunk: Chunk) -> bool:
        """Whether the chunk's tokens are computed as decode rows: by the CUDA graphs, or by the
        compiled CPU step once it is ready."""
        if chunk.seq.scores_prompt():
            return False
        if self.decode_graphs is not None:
            return chunk.num_tokens <= GRAPH_CHUNK_TOKENS
        return (self._step_layers is not None and chunk.num_tokens <= self.compiled_decode.max_rows
                and chunk.num_tokens * chunk.end <= CPU_RIDE_KEYS)

    def _mixed(self, batch: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        self.num_mixed_steps += 1
        if self._rides_together(batch, chunks):
            logits = self._graph_pass(batch, chunks)
        else:
            positions = [seq.length for seq in batch]
            tokens = int64_to_device([seq.pending_tokens[0] for seq in batch], self.device)
            new_tokens = int64_to_device([t for c in chunks for t in c.seq.prefill_tokens[c.seq.length:c.end]],
                                         self.device)
            logits = self.model.mixed(tokens, int64_to_device(positions, self.device), max(positions) + 1,
                                      self.cache, self.cache.block_table[: len(batch)], new_tokens, _segments(chunks))
        for seq in batch:
            seq.length += 1
            seq.pending_tokens = []
        for chunk in chunks:
            chunk.seq.length = chunk.end
        return logits if chunks[-1].last else logits[:-1]

    def _extend_pending(self, batch: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Feed the tokens still pending after the decoded one (forced by a grammar) through one
        `extend_batch`; each such sequence's row becomes its last pending token's logits."""
        pending = [(slot, seq) for slot, seq in enumerate(batch) if seq.pending_tokens]
        if not pending:
            return logits
        tokens = int64_to_device([t for _, seq in pending for t in seq.pending_tokens], self.device)
        segments = [Segment(slot, seq.length, len(seq.pending_tokens)) for slot, seq in pending]
        slots = int64_to_device([slot for slot, _ in pending], self.device)
        logits[slots] = self.model.extend_batch(tokens, self.cache, segments)
        for _, seq in pending:
            seq.length += len(seq.pending_tokens)
            seq.pending_tokens = []
        return logits

    def _prefill(self, chunks: list[Chunk]) -> torch.Tensor:
        """Extend each chunk's row with its tokens, several chunks per forward pass (the matmuls
        batched: a wave of prompts is prefilled in a few passes, not one pass each); each chunk's
        last-position logits, in order."""
        rows = []
        for batch in _prefill_passes(chunks, self._rides_graph, self._graph_rows()):
            seq = batch[0].seq
            if self._rides_graph(batch[0]):
                rows.append(self._graph_pass([], batch))
                continue
            if seq.scores_prompt():  # alone in its pass
                tokens = int64_to_device(seq.prefill_tokens[seq.length:batch[0].end], self.device)
                rows.append(self._extend_scoring_prompt(seq, tokens, batch[0].row).unsqueeze(0))
                continue
            tokens = int64_to_device([t for c in batch for t in c.seq.prefill_tokens[c.seq.length:c.end]], self.device)
            rows.append(self.model.extend_batch(tokens, self.cache, _segments(batch)))
        for chunk in chunks:
            chunk.seq.length = chunk.end
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _graph_rows(self) -> int:
        if self.decode_graphs is not None:
            return self.decode_graphs.max_rows
        return self.compiled_decode.max_rows if self._step_layers is not None else 0

    def _graph_pass(self, batch: list[Sequence], chunks: list[Chunk],
                    decode_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One replay of the decode graphs (on the CPU: one compiled step): row i of `batch` decodes
        its pending token (or decode_tokens[i], on the device) in cache row i, and every token of
        `chunks` is a row of its own; the decoded rows' logits, then each chunk's last token's."""
        prompt = [(token, position, c.row) for c in chunks
                  for position, token in enumerate(c.seq.prefill_tokens[c.seq.length:c.end], c.seq.length)]
        decoding = [(None if decode_tokens is not None else seq.pending_tokens[0], seq.length, row)
                    for row, seq in enumerate(batch)]
        rows = decoding + prompt
        ends = itertools.accumulate([len(batch), *(c.num_tokens for c in chunks)])
        picked = [*range(len(batch)), *(end - 1 for end in itertools.islice(ends, 1, None))]
        host_tokens = [r[0] for r in (prompt if decode_tokens is not None else rows)]
        inputs = int64_to_device([*host_tokens, *(r[1] for r in rows), *(r[2] for r in rows), *picked], self.device)
        n, t = len(rows), len(host_tokens)
        tokens = inputs[:t] if decode_tokens is None else torch.cat([decode_tokens, inputs[:t]])
        if self.decode_graphs is None:
            return self._compiled_pass(tokens, inputs[t:t + n], inputs[t + n:t + 2 * n], inputs[t + 2 * n:],
                                       max(r[1] for r in rows) + 1, may_spread=not batch and self._last_decoded <= 1)
        logits = self.decode_graphs.decode(tokens, inputs[t:t + n], inputs[t + n:t + 2 * n])
        return logits.index_select(0, inputs[t + 2 * n:])

    def _compiled_pass(self, tokens: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor,
                       picked: torch.Tensor, key_len: int, may_spread: bool) -> torch.Tensor:
        """`_graph_pass` on the CPU: the compiled decode step over rows that each name their cache
        row, the `picked` rows projected to the vocabulary; a step that only prefills, after at most
        one stream decoded, may run on more threads (`CompiledDecode.prompt_stance`)."""
        table = self._ride_table[: tokens.shape[0]]
        torch.index_select(self.cache.block_table, 0, cache_rows, out=table)
        compiled = self.compiled_decode
        with compiled.prompt_stance(tokens.shape[0], key_len) if may_spread else compiled.stance():
            return self.model.decode(tokens, positions, key_len, self.cache, table, self._step_layers, picked)

    def _extend_scoring_prompt(self, seq: Sequence, tokens: torch.Tensor, row: int) -> torch.Tensor:
        """`extend` with these tokens, also scoring the prompt tokens they predict under the model
        (raw logprobs, appended to seq.prompt_logprobs); forced tokens are not scored.

        The hidden states are projected here a chunk of positions at a time, to bound the
        (positions, vocab) memory.
        """
        start = seq.length
        hidden = self.model.extend_hidden(tokens, self.cache, [Segment(row, start, tokens.shape[0])])
        logits = self.model.logits(hidden[-1])
        prompt = seq.request.prompt_token_ids
        scored = min(start + tokens.shape[0], len(prompt) - 1) - start  # position p predicts prompt[p + 1]
        targets = int64_to_device(prompt[start + 1:start + 1 + max(scored, 0)], self.device)
        num_top = seq.request.sampling.prompt_logprobs
        for first in range(0, scored, _PROMPT_LOGPROBS_CHUNK):
            last = min(first + _PROMPT_LOGPROBS_CHUNK, scored)
            chunk_logprobs = self.model.logits(hidden[first:last]).log_softmax(dim=-1)
            seq.prompt_logprobs += token_logprobs(chunk_logprobs, targets[first:last], [num_top] * (last - first))[1]
        return logits


def _segments(chunks: list[Chunk]) -> list[Segment]:
    return [Segment(c.row, c.seq.length, c.num_tokens) for c in chunks]


def _prefill_passes(chunks: list[Chunk], rides_graph: Callable[[Chunk], bool], graph_rows: int
                    ) -> list[list[Chunk]]:
    """Consecutive chunks grouped into forward passes: graph replays of at most `graph_rows` tokens
    for the chunks that ride the graphs, eager passes of at most PREFILL_PASS_TOKENS tokens (a
    longer chunk runs alone) for the others; a chunk scoring its prompt's logprobs runs alone."""
    passes: list[list[Chunk]] = []
    tokens = 0
    for chunk in chunks:
        size = chunk.num_tokens
        graph = rides_graph(chunk)
        if (not passes or graph != rides_graph(passes[-1][0])
                or tokens + size > (graph_rows if graph else PREFILL_PASS_TOKENS)
                or chunk.seq.scores_prompt() or passes[-1][0].seq.scores_prompt()):
            passes.append([chunk])
            tokens = size
        else:
            passes[-1].append(chunk)
            tokens += size
    return passes
