"""A KV cache with one slot per running sequence.

Layout per layer: (slots, kv_heads, capacity, head_dim). Running sequences occupy slots
0..n-1 (the engine compacts on removal), so decode's row i is slot i: it writes and attends
there without gathering (`llgtrt_core.layers`: rope_write_kv, decode_attention). On CPU
the capacity grows by doubling up to the context length, so a server that only sees short
prompts never holds memory for long ones. On CUDA the whole
context is allocated up front, as many slots as free device memory allows: addresses never
change, which CUDA graphs of the decode step need.
"""

from __future__ import annotations

import torch

INITIAL_CAPACITY = 256
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
        capacity: int = INITIAL_CAPACITY,
    ):
        self.num_slots = num_slots
        self.max_len = max_len
        self.capacity = min(capacity, max_len)
        shape = (num_slots, num_kv_heads, self.capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_device(
        cls,
        num_layers: int,
        max_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> "KVCache":
        """A growing cache on CPU; on CUDA a full-context one with as many slots (up to max_slots) as fit."""
        if device.type != "cuda":
            return cls(num_layers, max_slots, num_kv_heads, head_dim, max_len, dtype, device)
        slot_bytes = 2 * num_layers * num_kv_heads * max_len * head_dim * dtype.itemsize
        free_bytes, _ = torch.cuda.mem_get_info(device)
        slots = min(max_slots, int(free_bytes * CUDA_MEMORY_FRACTION) // slot_bytes)
        if slots < 1:
            raise RuntimeError(f"one sequence of {max_len} tokens needs {slot_bytes / 2**30:.1f} GiB of KV cache; "
                               f"{free_bytes / 2**30:.1f} GiB are free: lower max_model_len")
        return cls(num_layers, slots, num_kv_heads, head_dim, max_len, dtype, device, capacity=max_len)

    def reserve(self, length: int) -> None:
        """Make room for `length` positions in every slot (doubling, capped at max_len)."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the cache's {self.max_len}")
        new_capacity = self.capacity
        while new_capacity < length:
            new_capacity *= 2
        new_capacity = min(new_capacity, self.max_len)
        for tensors in (self.keys, self.values):
            for layer, old in enumerate(tensors):
                grown = old.new_zeros(old.shape[0], old.shape[1], new_capacity, old.shape[3])
                grown[:, :, : self.capacity] = old
                tensors[layer] = grown
        self.capacity = new_capacity

    def write_extend(
        self, layer: int, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values: (kv_heads, seq, head_dim) for positions start..start+seq-1 of one slot;
        returns the slot's keys/values up to the last of them."""
        end = start + keys.shape[1]
        self.keys[layer][slot, :, start:end] = keys
        self.values[layer][slot, :, start:end] = values
        return self.keys[layer][slot, :, :end], self.values[layer][slot, :, :end]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions into slot dst (compaction after a removal)."""
        for tensors in (self.keys, self.values):
            for layer_tensor in tensors:
                layer_tensor[dst, :, :length] = layer_tensor[src, :, :length]
