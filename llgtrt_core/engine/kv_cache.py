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

On CUDA the blocks are allocated up front from free memory (addresses never change, which CUDA
graphs need); on CPU the pool doubles when it runs out (unless kv_cache_max_tokens fixes its
size), so a server that only sees short prompts holds little memory. The host keeps the
authoritative tables; `sync_table` uploads the rows changed since the last call in one copy,
before the forward pass that reads them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from llgtrt_core.kernels import int64_to_device
from llgtrt_core.layers.attention import gather_blocks

BLOCK_SIZE = 16  # positions per block
INITIAL_CPU_BLOCKS = 64
CUDA_MEMORY_FRACTION = 0.9  # of the memory free once the weights are loaded
SCRATCH_BLOCK = 0


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
        self._tables: list[list[int]] = [[] for _ in range(num_slots + 1)]
        self._free = list(range(blocks - 1, SCRATCH_BLOCK, -1))  # popped from the end: low blocks first
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
            return cls(num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device, block_size=block_size)
        else:
            blocks = max_blocks
        if max_tokens is not None:
            blocks = min(blocks, math.ceil(max_tokens / block_size) + 1)
        return cls(num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device, num_blocks=blocks,
                   block_size=block_size)

    # ---- allocation (host) -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0]

    @property
    def free_blocks(self) -> int:
        """Blocks free now, plus those a growable pool could still add."""
        return len(self._free) + (self.max_blocks - self.num_blocks if self.growable else 0)

    @property
    def usage(self) -> float:
        """Share of the pool's blocks held by sequences."""
        return 1 - len(self._free) / (self.num_blocks - 1)

    def blocks_held(self, row: int) -> int:
        return len(self._tables[row])

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def allocate(self, row: int, positions: int) -> bool:
        """Make row `row` hold blocks for its first `positions` positions (capped at max_len);
        False, changing nothing, when the pool cannot supply them."""
        table = self._tables[row]
        missing = self.blocks_for(min(positions, self.max_len)) - len(table)
        if missing <= 0:
            return True
        if missing > len(self._free) and not self._grow(missing - len(self._free)):
            return False
        table.extend(self._free.pop() for _ in range(missing))
        self._dirty.add(row)
        return True

    def free(self, row: int) -> None:
        """Return row `row`'s blocks to the pool."""
        self._free.extend(reversed(self._tables[row]))
        self._tables[row] = []
        self._dirty.add(row)

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s blocks now belong to the empty row `dst` (compaction after a removal)."""
        assert not self._tables[dst], "move into a row that holds blocks"
        self._tables[dst], self._tables[src] = self._tables[src], []
        self._dirty.update((src, dst))

    def reset(self) -> None:
        """Every row freed (after a failed step)."""
        for row in range(len(self._tables)):
            if self._tables[row]:
                self.free(row)

    def sync_table(self) -> None:
        """Upload the table rows changed since the last call (one pinned copy, no host sync);
        unused entries point at the scratch block."""
        if not self._dirty:
            return
        rows = sorted(self._dirty)
        self._dirty.clear()
        width = self.max_blocks_per_sequence
        flat = [block for row in rows for block in self._tables[row] + [SCRATCH_BLOCK] * (width - len(self._tables[row]))]
        device = self.block_table.device
        self.block_table[int64_to_device(rows, device)] = int64_to_device(flat, device).view(len(rows), width)

    def _grow(self, at_least: int) -> bool:
        """Double a growable pool (at least by `at_least` blocks, at most to max_blocks)."""
        old = self.num_blocks
        new = min(self.max_blocks, max(2 * old, old + at_least))
        if not self.growable or new - old < at_least:
            return False
        for tensors in (self.keys, self.values):
            for layer, tensor in enumerate(tensors):
                grown = tensor.new_zeros(new, *tensor.shape[1:])
                grown[:old] = tensor
                tensors[layer] = grown
        self._free[:0] = range(new - 1, old - 1, -1)  # the old free blocks stay first in line
        return True

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
