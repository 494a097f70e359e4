"""The KV cache's host-side block accounting with prefix caching (engine/block_manager.py): pure
Python, no model. Blocks of 4 positions keep the token lists short."""

from __future__ import annotations

import random

import pytest

from llgtrt_core.engine.block_manager import SCRATCH_BLOCK, BlockManager, block_hash

SIZE = 4


def manager(num_blocks: int = 32, **kwargs) -> BlockManager:
    return BlockManager(num_blocks, block_size=SIZE, **kwargs)


def run_prompt(blocks: BlockManager, key: object, tokens: list[int]) -> int:
    """Admit, allocate and 'prefill' a prompt the way the engine does; the cached positions."""
    cached = blocks.allocate_prompt(key, tokens)
    assert blocks.append(key, len(tokens) + 1)
    blocks.commit(key, tokens, len(tokens))
    return cached


def check_invariants(blocks: BlockManager) -> None:
    """Every block is exactly one of: free, evictable, held (refcount = the tables holding it)."""
    held: dict[int, int] = {}
    for table in blocks._tables.values():
        for block in table.blocks:
            held[block] = held.get(block, 0) + 1
    free, evictable = set(blocks._free), set(blocks._evictable)
    assert len(free) == len(blocks._free) and not free & evictable and not (free | evictable) & held.keys()
    assert free | evictable | held.keys() == set(range(1, blocks.num_blocks))
    assert all(blocks._refs[b] == n for b, n in held.items())
    assert all(blocks._refs[b] == 0 for b in free | evictable)
    assert evictable <= blocks._hash_of.keys()
    assert {b: h for h, b in blocks._by_hash.items()} == blocks._hash_of


def test_hash_chains_over_every_earlier_token() -> None:
    first = block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 3, 4]) == first
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert block_hash(block_hash(None, [9, 2, 3, 4]), [5, 6, 7, 8]) != block_hash(first, [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 5]) != first
    assert block_hash(None, [2**40, 0, 0, 0]) != block_hash(None, [0, 2**40 >> 32, 0, 0])  # no packing aliases


def test_a_second_prompt_shares_the_first_ones_full_blocks() -> None:
    blocks = manager()
    prompt = list(range(100, 114))  # 3 full blocks and 2 positions
    assert run_prompt(blocks, "a", prompt) == 0
    cached = run_prompt(blocks, "b", prompt[:12] + [7, 7, 7])  # a different tail after 3 full blocks
    assert cached == 12
    assert blocks.blocks("b")[:3] == blocks.blocks("a")[:3]
    assert blocks.blocks("b")[3] != blocks.blocks("a")[3]
    assert [blocks._refs[b] for b in blocks.blocks("a")] == [2, 2, 2, 1]
    assert (blocks.queries, blocks.hits) == (14 + 15, 12)
    check_invariants(blocks)


def test_the_last_token_is_always_computed() -> None:
    blocks = manager()
    prompt = list(range(12))  # exactly 3 blocks
    run_prompt(blocks, "a", prompt)
    assert blocks.cached_blocks == 3
    assert blocks.allocate_prompt("b", prompt) == 8  # the block holding the last token is computed again
    assert blocks.allocate_prompt("c", prompt[:5]) == 4
    assert blocks.allocate_prompt("d", prompt[:4]) == 0
    check_invariants(blocks)


def test_a_lookup_reuses_the_names_it_is_given() -> None:
    """A waiting request is looked up every step; the names of its blocks from the last lookup are
    not hashed again (given names are trusted: another prompt's names find that prompt's blocks)."""
    blocks = manager()
    cached = list(range(100, 114))
    run_prompt(blocks, "a", cached)
    waiting = cached[:12] + [7, 7, 7, 7, 7]
    first = blocks.lookup(waiting)
    assert len(first.blocks) == 3 and len(first.hashes) == 4
    assert blocks.lookup(waiting, first.hashes) == first
    other = list(range(200, 217))
    assert blocks.lookup(other).blocks == ()
    assert blocks.lookup(other, first.hashes).blocks == first.blocks


def test_a_different_earlier_token_means_no_hit() -> None:
    blocks = manager()
    run_prompt(blocks, "a", list(range(20)))
    assert blocks.allocate_prompt("b", [99] + list(range(1, 20))) == 0  # first block differs: nothing later matches
    assert blocks.allocate_prompt("c", list(range(4)) + [99] + list(range(5, 20))) == 4


def test_released_blocks_stay_cached_and_are_reused() -> None:
    blocks = manager()
    prompt = list(range(30))
    run_prompt(blocks, "a", prompt)
    held = blocks.blocks("a")[:7]
    blocks.free("a")
    assert blocks.usage == 0 and blocks.cached_blocks == 7
    check_invariants(blocks)
    assert run_prompt(blocks, "b", prompt) == 28
    assert blocks.blocks("b")[:7] == held
    check_invariants(blocks)


def test_generated_blocks_are_registered_and_a_preempted_sequence_resumes_from_them() -> None:
    blocks = manager()
    prompt = list(range(6))
    run_prompt(blocks, "a", prompt)
    tokens = prompt + [50, 51, 52, 53, 54, 55, 56]  # decoded one by one
    for length in range(len(prompt) + 1, len(tokens) + 1):
        assert blocks.append("a", length + 1)
        blocks.commit("a", tokens, length)
    assert blocks.cached_blocks == 3  # positions 0..11 are full blocks
    blocks.free("a")  # preempted: recompute prompt + emitted tokens
    assert blocks.allocate_prompt("a", tokens) == 12
    check_invariants(blocks)


def test_eviction_takes_the_least_recently_released_block_first() -> None:
    blocks = manager(num_blocks=9)  # 8 usable blocks
    run_prompt(blocks, "old", list(range(100, 108)))  # 2 full blocks + 1 for the next position
    run_prompt(blocks, "new", list(range(200, 208)))
    old, new = blocks.blocks("old")[:2], blocks.blocks("new")[:2]
    blocks.free("old")
    blocks.free("new")
    assert blocks.free_blocks == 8 and blocks.cached_blocks == 4
    assert blocks.append("x", 5 * SIZE)  # 4 free blocks, then 1 evicted: old's, its tail first
    assert blocks.evictions == 1 and blocks.cached_blocks == 3
    assert old[1] in blocks.blocks("x")
    assert blocks.allocate_prompt("y", list(range(100, 109))) == 4  # old's first block survived
    assert blocks.allocate_prompt("z", list(range(200, 209))) == 8  # and new's two
    assert blocks.blocks("y") == old[:1] and blocks.blocks("z") == new
    check_invariants(blocks)


def test_a_hit_refreshes_a_block_in_the_lru_order() -> None:
    blocks = manager(num_blocks=7)  # 6 usable
    run_prompt(blocks, "a", list(range(100, 104)) + [1])  # 1 full block (+1)
    run_prompt(blocks, "b", list(range(200, 204)) + [1])
    a_block = blocks.blocks("a")[0]
    blocks.free("a")
    blocks.free("b")
    assert run_prompt(blocks, "c", list(range(100, 104)) + [2]) == 4  # a's block used again, then released last
    blocks.free("c")
    assert blocks.append("x", 5 * SIZE)  # free blocks first, then b's (older), then a's
    assert blocks.cached_blocks == 1 and a_block not in blocks.blocks("x")
    check_invariants(blocks)


def test_blocks_held_by_running_sequences_are_never_evicted() -> None:
    blocks = manager(num_blocks=5)  # 4 usable
    run_prompt(blocks, "a", list(range(8)))  # 3 blocks held
    assert blocks.free_blocks == 1
    assert not blocks.append("b", 2 * SIZE)  # refused, nothing changed
    assert blocks.blocks("b") == [] and blocks.free_blocks == 1
    check_invariants(blocks)


def test_a_shared_block_survives_until_its_last_holder_leaves() -> None:
    blocks = manager()
    prompt = list(range(9))
    run_prompt(blocks, "a", prompt)
    run_prompt(blocks, "b", prompt)
    shared = blocks.blocks("a")[:2]
    blocks.free("a")
    assert all(blocks._refs[b] == 1 for b in shared) and not set(shared) & set(blocks._evictable)
    blocks.free("b")
    assert set(shared) <= set(blocks._evictable)
    check_invariants(blocks)


def test_twins_computed_at_once_keep_one_name() -> None:
    blocks = manager()
    prompt = list(range(9))
    assert blocks.allocate_prompt("a", prompt) == 0 and blocks.allocate_prompt("b", prompt) == 0  # same step
    for key in ("a", "b"):
        assert blocks.append(key, 10)
        blocks.commit(key, prompt, 9)
    assert blocks.cached_blocks == 2
    a, b = blocks.blocks("a")[:2], blocks.blocks("b")[:2]
    blocks.free("b")
    assert not set(b) & set(blocks._evictable)  # b's unnamed twins went back to the free list
    assert blocks.allocate_prompt("c", prompt) == 8 and blocks.blocks("c") == a
    check_invariants(blocks)


def test_caching_off_shares_nothing_and_counts_nothing() -> None:
    blocks = manager(enable_caching=False)
    prompt = list(range(20))
    run_prompt(blocks, "a", prompt)
    blocks.free("a")
    assert run_prompt(blocks, "b", prompt) == 0
    assert blocks.cached_blocks == 0 and (blocks.queries, blocks.hits) == (0, 0)
    assert blocks.usage == pytest.approx(6 / 31)
    check_invariants(blocks)


def test_growable_pool_evicts_before_it_grows() -> None:
    blocks = BlockManager(5, max_blocks=40, block_size=SIZE)
    run_prompt(blocks, "a", list(range(12)))  # 4 blocks: all 4 usable
    blocks.free("a")
    assert blocks.append("b", 2 * SIZE) and blocks.num_blocks == 5 and blocks.evictions == 1
    assert blocks.append("b", 8 * SIZE) and blocks.num_blocks == 10  # doubled once live blocks needed it
    assert blocks.free_blocks == 40 - 1 - 8
    check_invariants(blocks)


def test_move_and_reset() -> None:
    blocks = manager()
    run_prompt(blocks, 3, list(range(10)))
    held = blocks.blocks(3)
    blocks.move(3, 1)
    assert blocks.blocks(1) == held and blocks.blocks(3) == []
    blocks.reset()
    assert blocks.usage == 0 and blocks.cached_blocks == 0
    assert blocks.allocate_prompt("a", list(range(10))) == 0
    check_invariants(blocks)


def test_scratch_block_is_never_handed_out() -> None:
    blocks = BlockManager(3, max_blocks=20, block_size=SIZE)
    assert blocks.append("a", 19 * SIZE)
    assert SCRATCH_BLOCK not in blocks.blocks("a") and not blocks.append("b", 1)


def test_random_workload_keeps_the_books_and_shares_what_it_can() -> None:
    """Many sequences over a few shared prefixes, admitted, grown, preempted and finished at random
    under memory pressure: the invariants hold after every operation, and every hit is a prefix of
    tokens the hit blocks were computed for."""
    seed = 20
    rng = random.Random(seed)
    blocks = BlockManager(24, max_blocks=24, block_size=SIZE)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    contents: dict[int, tuple[int, ...]] = {}  # block -> the tokens of every position up to its end
    live: dict[int, list[int]] = {}
    for key in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        hit = blocks.lookup(tokens)
        if blocks.blocks_for(len(tokens) + 1) - hit.shared > blocks.free_blocks:
            victim = rng.choice(list(live))  # preempt one, as the engine does
            blocks.free(victim)
            del live[victim]
            check_invariants(blocks)
            continue
        cached = blocks.allocate_prompt(key, tokens, hit)
        for index, block in enumerate(blocks.blocks(key)):
            assert contents[block] == tuple(tokens[:(index + 1) * SIZE]), f"seed {seed}: a hit on other tokens"
        assert blocks.append(key, len(tokens) + 1)
        for index, block in enumerate(blocks.blocks(key)[cached // SIZE:], cached // SIZE):
            contents[block] = tuple(tokens[:(index + 1) * SIZE])  # what the prefill writes
        blocks.commit(key, tokens, len(tokens))
        live[key] = tokens
        check_invariants(blocks)
        for done in [k for k in live if rng.random() < 0.3]:
            blocks.free(done)
            del live[done]
            check_invariants(blocks)
    assert blocks.hits > 0 and blocks.evictions > 0, f"seed {seed}"
