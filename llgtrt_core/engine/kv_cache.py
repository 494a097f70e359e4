"""A block-allocated (paged) KV cache.

Layout per layer: (blocks, kv_heads, block_size, head_dim). A sequence owns a list of blocks,
one per `block_size` positions, taken from a shared free list as it grows and returned when it
leaves, so memory follows the tokens actually held, not max_model_len per sequence. Row r of
`block_table` (rows, max_blocks_per_sequence) lists the blocks of the sequence in row r:
position p of that sequence lives at block block_table[r, p // block_size], offset
p % block_size. Running sequences use rows 0..n-1 (decode's row i is table row i); the extra
last row holds a prompt being prefilled a chunk per step, out of the way of the decode.

Block 0 is never handed out: entries of unused table rows point at it, so padding rows of a
CUDA-graph decode write there and harm nobody.

Which blocks a row holds, and which hold a cached prompt prefix, is the host-only
`BlockManager`'s business (block_manager.py), keyed by row here; this class owns the tensors, the
device's copy of the tables and the pool's growth, which follows the manager's.

On CUDA the blocks are allocated up front from free memory (addresses never change, which CUDA
graphs need); on CPU the pool doubles when it runs out (unless kv_cache_max_tokens fixes its
size), so a server that only sees short prompts holds little memory. The host keeps the
authoritative tables; `sync_table` uploads the rows changed since the last call in one copy,
before the forward pass that reads them.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from llgtrt_core.engine.block_manager import BLOCK_SIZE, SCRATCH_BLOCK, BlockManager, PrefixHit
from llgtrt_core.kernels import int64_to_device
from llgtrt_core.layers.attention import gather_blocks

INITIAL_CPU_BLOCKS = 64
CUDA_MEMORY_FRACTION = 0.9  # of the memory free once the weights are loaded


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: Optional[int] = None,  # None: grow on demand (CPU); else a fixed pool, scratch included
        block_size: int = BLOCK_SIZE,
        prefix_caching: bool = False,
    ):
        self.num_slots = num_slots  # rows 0..num_slots-1 decode; row num_slots is the prefill row
        self.prefill_row = num_slots
        self.max_len = max_len
        self.block_size = block_size
        self.max_blocks_per_sequence = math.ceil(max_len / block_size)
        self.max_blocks = pool_limit(num_slots, max_len, block_size)
        self.growable = num_blocks is None
        blocks = min(INITIAL_CPU_BLOCKS, self.max_blocks) if num_blocks is None else num_blocks
        if not self.growable and blocks < self.max_blocks_per_sequence + 1:
            raise ValueError(f"a KV cache of {(blocks - 1) * block_size} tokens cannot hold one sequence of "
                             f"{max_len} (max_model_len)")
        shape = (blocks, num_kv_heads, block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_table = torch.zeros(num_slots + 1, self.max_blocks_per_sequence, dtype=torch.long, device=device)
        self.blocks = BlockManager(blocks, self.max_blocks if self.growable else blocks, block_size, prefix_caching)
        self._dirty: set[int] = set()

    @classmethod
    def for_device(
        cls,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        memory_fraction: float = CUDA_MEMORY_FRACTION,
        max_tokens: Optional[int] = None,
        block_size: int = BLOCK_SIZE,
        prefix_caching: bool = False,
    ) -> "KVCache":
        """On CUDA, as many blocks as `memory_fraction` of the free device memory holds; on CPU a
        pool that grows. `max_tokens` caps either (on CPU it fixes the pool's size)."""
        max_blocks = pool_limit(num_slots, max_len, block_size)
        if device.type == "cuda":
            block_bytes = 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize
            free_bytes, _ = torch.cuda.mem_get_info(device)
            blocks = min(max_blocks, int(free_bytes * memory_fraction) // block_bytes)
            needed = math.ceil(max_len / block_size) + 1
            if blocks < needed:
                raise RuntimeError(f"one sequence of {max_len} tokens needs {needed * block_bytes / 2**30:.1f} GiB "
                                   f"of KV cache; {free_bytes / 2**30:.1f} GiB are free: lower max_model_len")
        elif max_tokens is None:
            return cls(num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device, block_size=block_size,
                       prefix_caching=prefix_caching)
        else:
            blocks = max_blocks
        if max_tokens is not None:
            blocks = min(blocks, math.ceil(max_tokens / block_size) + 1)
        return cls(num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device, num_blocks=blocks,
                   block_size=block_size, prefix_caching=prefix_caching)

    # ---- allocation (host) -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0]

    @property
    def free_blocks(self) -> int:
        """Blocks a row could take now (cached ones included), plus those a growable pool could still add."""
        return self.blocks.free_blocks

    @property
    def usage(self) -> float:
        """Share of the pool's blocks held by sequences."""
        return self.blocks.usage

    @property
    def prefix_caching(self) -> bool:
        return self.blocks.enable_caching

    def blocks_held(self, row: int) -> int:
        return self.blocks.blocks_held(row)

    def blocks_for(self, positions: int) -> int:
        return self.blocks.blocks_for(positions)

    def shared(self, row: int, position: int) -> bool:
        """Whether row `row`'s `position` may be read by another row (a prefix-cache block)."""
        return self.blocks.registered(row, position)

    def lookup(self, tokens: list[int], known: tuple[bytes, ...] = ()) -> PrefixHit:
        """`tokens`' leading blocks in the prefix cache (changes nothing); see BlockManager.lookup."""
        return self.blocks.lookup(tokens, known)

    def allocate_prompt(self, row: int, tokens: list[int], hit: PrefixHit) -> int:
        """Row `row` (holding no blocks) starts with `hit`'s cached blocks; the positions they hold."""
        self._dirty.add(row)
        return self.blocks.allocate_prompt(row, tokens, hit)

    def allocate(self, row: int, positions: int) -> bool:
        """Make row `row` hold blocks for its first `positions` positions (capped at max_len);
        False, changing nothing, when the pool cannot supply them."""
        held = self.blocks.blocks_held(row)
        if not self.blocks.append(row, min(positions, self.max_len)):
            return False
        if self.blocks.blocks_held(row) != held:
            self._dirty.add(row)
            self._follow_growth()
        return True

    def short_rows(self, positions: list[int]) -> list[int]:
        """The rows (0 .. len(positions) - 1) for which `allocate(row, positions[row])` has blocks to
        add: at a decode step a row crosses into a new block once every `block_size` tokens, so the
        others are passed over without a call each."""
        held = self.blocks.positions_held(range(len(positions)))
        max_len = self.max_len
        return [row for row, (wanted, have) in enumerate(zip(positions, held)) if min(wanted, max_len) > have]

    def commit(self, row: int, tokens: list[int], computed: int) -> None:
        """Row `row`'s KV is computed for its first `computed` positions, `tokens[:computed]`: its full
        blocks among them join the prefix cache."""
        self.blocks.commit(row, tokens, computed)

    def free(self, row: int) -> None:
        """Release row `row`'s blocks (cached ones stay cached until evicted)."""
        self.blocks.free(row)
        self._dirty.add(row)

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s blocks now belong to the empty row `dst` (compaction after a removal)."""
        self.blocks.move(src, dst)
        self._dirty.update((src, dst))

    def reset(self) -> None:
        """Every row freed and the prefix cache emptied (after a failed step)."""
        self.blocks.reset()
        self._dirty.update(range(self.num_slots + 1))

    def sync_table(self) -> None:
        """Upload the table rows changed since the last call (one pinned copy, no host sync);
        unused entries point at the scratch block."""
        if not self._dirty:
            return
        rows = sorted(self._dirty)
        self._dirty.clear()
        table = np.full((len(rows), self.max_blocks_per_sequence), SCRATCH_BLOCK, dtype=np.int64)
        for i, row in enumerate(rows):
            blocks = self.blocks.blocks(row)
            table[i, :len(blocks)] = blocks
        device = self.block_table.device
        self.block_table[int64_to_device(rows, device)] = int64_to_device(table, device)

    def _follow_growth(self) -> None:
        """Grow the tensors to the block manager's pool (which grows a growable pool on demand)."""
        old, new = self.num_blocks, self.blocks.num_blocks
        if new == old:
            return
        for tensors in (self.keys, self.values):
            for layer, tensor in enumerate(tensors):
                # Normal tensors like the first ones, though steps run in inference mode: a compiled
                # decode (compiled_decode.py) has graphs for one kind of tensor, not both.
                with torch.inference_mode(False):
                    grown = tensor.new_zeros(new, *tensor.shape[1:])
                    grown[:old] = tensor
                tensors[layer] = grown

    # ---- reads and writes (device) ------------------------------------------------------

    def locate(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each (row, position) pair, from the device table."""
        return self.block_table[rows, positions // self.block_size], positions % self.block_size

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """keys/values: (tokens, kv_heads, head_dim), token i stored at (blocks[i], offsets[i])."""
        self.keys[layer][blocks, :, offsets] = keys
        self.values[layer][blocks, :, offsets] = values

    def read(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys and values at positions 0..length-1, gathered: (kv_heads, length, head_dim)."""
        blocks = self.block_table[row, : self.blocks_for(length)]
        return gather_blocks(self.keys[layer], blocks, length), gather_blocks(self.values[layer], blocks, length)


def pool_limit(num_slots: int, max_len: int, block_size: int) -> int:
    """Blocks of a pool with every row full, plus the scratch block: more could never be used."""
    return (num_slots + 1) * math.ceil(max_len / block_size) + 1
