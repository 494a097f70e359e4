"""The paged KV cache's block accounting, on the host, with prefix caching (no torch here).

The cache is a pool of blocks of `block_size` positions; block 0 is scratch and never handed out.
Each sequence (any hashable key) owns a list of blocks, position p in block p // block_size.

Prefix caching (vLLM's automatic prefix caching): a full block is named by a hash of its tokens
chained over every token before them, `block_hash(parent, tokens)`, and registered under that name
once its KV is computed (`commit`). A new prompt's leading full blocks that are registered are
shared instead of recomputed (`allocate_prompt`), a reference count per block. A registered block
no sequence holds any more keeps its KV in an evictable set, least recently released first; a fresh
block comes from the free list, else from that set (its name dropped), else from growing the pool.
Only blocks before a prompt's last token are looked up, so the last token is always computed (its
logits start the answer) and no sequence ever writes into a shared block: what it computes lands in
blocks of its own.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Sequence

BLOCK_SIZE = 16  # positions per block
SCRATCH_BLOCK = 0


def block_hash(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """A full block's name: its tokens and, through its parent's name, every token before them.
    A cryptographic hash: a collision would hand one prompt another's KV."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class PrefixHit:
    """A prompt's leading blocks found in the cache (`BlockManager.lookup`)."""

    blocks: tuple[int, ...]  # registered blocks, one per leading full block of the prompt
    hashes: tuple[bytes, ...]  # the names of every full block before the prompt's last token
    shared: int  # of `blocks`, those some sequence holds now: sharing them takes nothing from the pool


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # names of its first full blocks, known so far
    committed: int = 0  # its first blocks that are named and, unless a twin was first, registered


class BlockManager:
    def __init__(self, num_blocks: int, max_blocks: Optional[int] = None, block_size: int = BLOCK_SIZE,
                 enable_caching: bool = True) -> None:
        """num_blocks: the pool, scratch block included; it grows on demand up to max_blocks
        (default: it never grows). The device side follows `num_blocks`."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks = max(max_blocks or num_blocks, num_blocks)
        self.enable_caching = enable_caching
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # popped from the end: low blocks first
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody; oldest first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._tables: dict[Hashable, _Table] = {}
        # Prompt tokens looked up and found (vLLM's prefix_cache_queries / prefix_cache_hits), blocks evicted.
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # ---- the pool --------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence could take now: free, evictable, or still to be added by growing."""
        return len(self._free) + len(self._evictable) + self.max_blocks - self.num_blocks

    @property
    def usage(self) -> float:
        """Share of the pool's blocks held by sequences (evictable ones count as free)."""
        return 1 - (len(self._free) + len(self._evictable)) / (self.num_blocks - 1)

    @property
    def cached_blocks(self) -> int:
        """Blocks registered under their name, held or evictable."""
        return len(self._by_hash)

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    # ---- sequences -------------------------------------------------------------------

    def blocks(self, key: Hashable) -> list[int]:
        """The blocks of `key`'s positions, in order (do not modify)."""
        table = self._tables.get(key)
        return table.blocks if table is not None else []

    def blocks_held(self, key: Hashable) -> int:
        return len(self.blocks(key))

    def positions_held(self, keys: Iterable[Hashable]) -> list[int]:
        """The positions each key's blocks hold (0 for a key that holds none)."""
        tables, size = self._tables, self.block_size
        return [len(tables[key].blocks) * size if key in tables else 0 for key in keys]

    def registered(self, key: Hashable, position: int) -> bool:
        """Whether `key`'s `position` lies in a block that is (or may be) shared through the prefix
        cache: its KV must not be written again."""
        table = self._tables.get(key)
        return table is not None and position // self.block_size < table.committed

    def lookup(self, tokens: Sequence[int], known: Sequence[bytes] = ()) -> PrefixHit:
        """The registered blocks that hold `tokens`' leading full blocks, before its last token
        (changes nothing). known: names already computed for these tokens' first blocks (an earlier
        lookup's `hashes`, for a request that waits), not hashed again."""
        if not self.enable_caching:
            return PrefixHit((), (), 0)
        size = self.block_size
        hashes: list[bytes] = []
        blocks: list[int] = []
        parent: Optional[bytes] = None
        for index, start in enumerate(range(0, len(tokens) - size, size)):  # blocks ending before the last token
            parent = known[index] if index < len(known) else block_hash(parent, tokens[start:start + size])
            hashes.append(parent)
            block = self._by_hash.get(parent) if len(blocks) == len(hashes) - 1 else None
            if block is not None:
                blocks.append(block)
        return PrefixHit(tuple(blocks), tuple(hashes), sum(self._refs[b] > 0 for b in blocks))

    def allocate_prompt(self, key: Hashable, tokens: Sequence[int], hit: Optional[PrefixHit] = None) -> int:
        """Start `key`'s table with the cached blocks of `tokens`' prefix (`hit`, from `lookup` in the
        same step, or looked up now); the number of leading positions already computed, always less
        than len(tokens). Blocks for the rest come from `append`."""
        assert key not in self._tables, "allocate_prompt for a key that holds blocks"
        hit = self.lookup(tokens) if hit is None else hit
        for block in hit.blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        self._tables[key] = _Table(list(hit.blocks), list(hit.hashes), len(hit.blocks))
        if self.enable_caching:
            self.queries += len(tokens)
            self.hits += len(hit.blocks) * self.block_size
        return len(hit.blocks) * self.block_size

    def append(self, key: Hashable, positions: int) -> bool:
        """Make `key` hold blocks for its first `positions` positions; False, changing nothing, when
        the pool cannot supply them."""
        table = self._tables.setdefault(key, _Table())
        missing = self.blocks_for(positions) - len(table.blocks)
        if missing <= 0:
            return True
        if missing > self.free_blocks:
            return False
        for _ in range(missing):
            block = self._take_fresh()
            self._refs[block] = 1
            table.blocks.append(block)
        return True

    def commit(self, key: Hashable, tokens: Sequence[int], computed: int) -> None:
        """`key`'s KV is computed for its first `computed` positions, which hold `tokens[:computed]`
        (the prompt given to `allocate_prompt`, then what followed): register its full blocks among
        them under their names."""
        if not self.enable_caching:
            return
        table = self._tables[key]
        size = self.block_size
        for index in range(table.committed, min(computed // size, len(table.blocks))):
            if index == len(table.hashes):
                parent = table.hashes[-1] if table.hashes else None
                table.hashes.append(block_hash(parent, tokens[index * size:(index + 1) * size]))
            name = table.hashes[index]
            if name not in self._by_hash:  # else a twin computed elsewhere was first: this block stays unnamed
                self._by_hash[name] = table.blocks[index]
                self._hash_of[table.blocks[index]] = name
            table.committed = index + 1

    def free(self, key: Hashable) -> None:
        """Release `key`'s blocks: registered ones become evictable (its last blocks first in line, as
        the least likely to be shared), the others free."""
        table = self._tables.pop(key, None)
        if table is None:
            return
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def move(self, src: Hashable, dst: Hashable) -> None:
        """`src`'s blocks now belong to `dst`, which holds none."""
        assert not self.blocks(dst), "move into a key that holds blocks"
        table = self._tables.pop(src, None)
        if table is not None:
            self._tables[dst] = table

    def reset(self) -> None:
        """Every sequence freed and the cache forgotten (after a failed step, whose KV is suspect)."""
        for key in list(self._tables):
            self.free(key)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._by_hash.clear()
        self._hash_of.clear()

    def _take_fresh(self) -> int:
        """A block for new KV: a free one, else the least recently released cached one, else a new one."""
        if self._free:
            return self._free.pop()
        if self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            self.evictions += 1
            return block
        self._grow()
        return self._free.pop()

    def _grow(self) -> None:
        """Double the pool, at most to max_blocks."""
        old = self.num_blocks
        new = min(self.max_blocks, 2 * old)
        assert new > old, "grow past max_blocks"
        self.num_blocks = new
        self._refs += [0] * (new - old)
        self._free[:0] = range(new - 1, old - 1, -1)
