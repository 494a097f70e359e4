"""The scheduler on its own: no model, no forward pass, only its plans and its bookkeeping over a
small CPU KV cache's blocks (16 positions each)."""

from __future__ import annotations

import torch

from llgtrt_core.engine.interface import GenerationRequest, SamplingParams, TokenDelta
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.scheduler import Scheduler
from llgtrt_core.engine.sequence import Sequence


def nothing_ends(seq: Sequence) -> bool:
    """No running sequence ends this step."""
    return False


class Harness:
    """A scheduler over a fixed pool of `blocks` usable blocks, recording its callbacks."""

    def __init__(self, slots: int = 4, blocks: int = 16, chunk: int | None = None, max_len: int = 128):
        self.cache = KVCache(1, slots, 1, 4, max_len, torch.float32, torch.device("cpu"), num_blocks=blocks + 1)
        self.joined: list[tuple[str, int]] = []
        self.moved: list[tuple[int, int]] = []
        self.deltas: dict[str, list[TokenDelta]] = {}
        self.scheduler = Scheduler(self.cache, chunk, self.prepare, self.on_join, self.moved_row)

    def prepare(self, seq: Sequence) -> None:
        seq.token_ids = list(seq.request.prompt_token_ids)
        seq.prefill_tokens = list(seq.request.prompt_token_ids)

    def on_join(self, seq: Sequence, slot: int) -> None:
        self.joined.append((seq.request_id, slot))

    def moved_row(self, src: int, dst: int) -> None:
        self.moved.append((src, dst))

    def add(self, request_id: str, prompt_len: int) -> Sequence:
        request = GenerationRequest(request_id, list(range(prompt_len)), SamplingParams(max_tokens=8))
        seq = Sequence(request, self.deltas.setdefault(request_id, []).append, generator=None)
        self.scheduler.add(seq)
        return seq

    def run_plan(self, admit: bool = True):
        """Schedule a step and play the forward pass's part: chunks advance their lengths, every
        decoding row writes its pending token and gets a new one."""
        plan = self.scheduler.schedule(admit)
        if plan is None:
            return None
        for seq in self.scheduler.running[:plan.num_decoding]:
            seq.length += len(seq.pending_tokens)
        for chunk in plan.chunks:
            chunk.seq.length = chunk.end
            if chunk.last:
                chunk.seq.prefill_tokens = []
        for seq in self.scheduler.running:
            seq.token_ids.append(0)
            seq.pending_tokens = [0]
        return plan


def test_waiting_prompts_join_running_rows_in_order():
    h = Harness()
    for i, n in enumerate([5, 20, 3]):
        h.add(f"r{i}", n)
    plan = h.run_plan()
    assert plan.num_decoding == 0
    assert [(c.seq.request_id, c.row, c.end, c.last) for c in plan.chunks] == [
        ("r0", 0, 5, True), ("r1", 1, 20, True), ("r2", 2, 3, True)]
    assert h.joined == [("r0", 0), ("r1", 1), ("r2", 2)]
    # Each holds blocks for its prompt and the next position: 5+1 -> 1 block, 20+1 -> 2, 3+1 -> 1.
    assert [h.cache.blocks_held(r) for r in range(3)] == [1, 2, 1]
    plan = h.run_plan()
    assert plan.num_decoding == 3 and plan.chunks == []


def test_no_free_row_keeps_a_request_waiting():
    h = Harness(slots=2)
    for i in range(3):
        h.add(f"r{i}", 4)
    h.run_plan()
    assert [s.request_id for s in h.scheduler.running] == ["r0", "r1"]
    assert [s.request_id for s in h.scheduler.waiting] == ["r2"]
    first_ends = lambda seq: seq is h.scheduler.running[0]  # noqa: E731
    assert not h.scheduler.admits_next(nothing_ends, arrived=False)
    assert h.scheduler.admits_next(first_ends, arrived=False)
    h.scheduler.remove(0)
    assert h.scheduler.admits_next(nothing_ends, arrived=False)
    h.run_plan()
    assert not h.scheduler.admits_next(first_ends, arrived=False)  # nobody waits
    assert h.scheduler.admits_next(first_ends, arrived=True)


def test_a_long_prompt_is_prefilled_a_chunk_per_step_in_the_prefill_row():
    h = Harness(chunk=16)
    h.add("short", 4)
    h.add("long", 40)
    plan = h.run_plan()
    # The short prompt takes 4 of the 16 tokens; the long one starts in the prefill row.
    assert [(c.seq.request_id, c.row, c.end, c.last) for c in plan.chunks] == [
        ("short", 0, 4, True), ("long", h.cache.prefill_row, 12, False)]
    assert h.scheduler.prefilling.request_id == "long" and h.scheduler.admits_next(nothing_ends, arrived=False)
    plan = h.run_plan()
    assert plan.num_decoding == 1 and [(c.row, c.end, c.last) for c in plan.chunks] == [(h.cache.prefill_row, 28, False)]
    plan = h.run_plan()
    assert [(c.row, c.end, c.last) for c in plan.chunks] == [(1, 40, True)]
    assert h.scheduler.prefilling is None and h.joined[-1] == ("long", 1)
    assert h.cache.blocks_held(h.cache.prefill_row) == 0 and h.cache.blocks_held(1) == 3


def test_the_newest_sequence_is_preempted_when_blocks_run_out():
    h = Harness(slots=2, blocks=4, max_len=64)
    old = h.add("old", 30)  # 2 blocks
    h.run_plan()
    new = h.add("new", 14)  # 1 block, and 1 spare for old's growth while it is prefilled
    h.run_plan()
    assert [s.request_id for s in h.scheduler.running] == ["old", "new"]
    while h.scheduler.num_preemptions == 0:  # old grows into the last free block, then needs another
        assert h.run_plan() is not None
    assert [s.request_id for s in h.scheduler.running] == ["old"]
    assert list(h.scheduler.waiting) == [new]
    # Preempted: it will prefill everything it had (prompt and emitted tokens) again from position 0.
    assert new.length == 0 and new.prefill_tokens == new.token_ids and new.pending_tokens == []
    assert old.length + len(old.pending_tokens) + 1 <= 16 * h.cache.blocks_held(0)


def test_removing_a_row_moves_the_last_into_the_hole():
    h = Harness()
    for i in range(3):
        h.add(f"r{i}", 4)
    h.run_plan()
    blocks_of_last = list(h.cache.blocks.blocks(2))
    h.scheduler.remove(0)
    assert [s.request_id for s in h.scheduler.running] == ["r2", "r1"]
    assert h.moved == [(2, 0)] and h.cache.blocks.blocks(0) == blocks_of_last and h.cache.blocks_held(2) == 0
    h.scheduler.remove(1)  # the last row: nothing moves
    assert [s.request_id for s in h.scheduler.running] == ["r2"] and h.moved == [(2, 0)]


def test_abort_ends_a_request_wherever_it_is():
    h = Harness(slots=1, chunk=16)
    h.add("running", 4)
    h.run_plan()
    h.add("waiting", 4)
    for request_id in ["waiting", "running"]:
        h.scheduler.abort(request_id)
        assert [d.finish_reason for d in h.deltas[request_id]] == ["abort"]
    assert h.scheduler.idle() and h.cache.free_blocks == 16
    h.add("prefilling", 40)
    h.run_plan()
    assert h.scheduler.prefilling is not None
    h.scheduler.abort("prefilling")
    assert h.scheduler.idle() and h.cache.free_blocks == 16
    assert [d.finish_reason for d in h.deltas["prefilling"]] == ["abort"]



def test_prompts_admitted_ahead_ride_whole_and_a_long_one_waits_in_progress():
    """admit_ahead (mid-step, the decode about to be queued ahead): short prompts join the running
    rows as last chunks up to the token budget; the first one over the per-chunk limit is admitted
    into the prefill row and left for the next step's plan, which prefills it there."""
    h = Harness(slots=4, blocks=16)
    h.add("a", 5)
    h.run_plan()  # "a" runs in row 0
    for request_id, n in (("b", 6), ("c", 7), ("d", 40), ("e", 3)):
        h.add(request_id, n)
    chunks = h.scheduler.admit_ahead(max_tokens=100, max_chunk_tokens=16)
    assert [(c.seq.request_id, c.row, c.end, c.last) for c in chunks] == [("b", 1, 6, True), ("c", 2, 7, True)]
    assert [s.request_id for s in h.scheduler.running] == ["a", "b", "c"]
    assert h.scheduler.prefilling.request_id == "d" and [s.request_id for s in h.scheduler.waiting] == ["e"]
    for chunk in chunks:  # what the engine's queued-ahead pass does
        chunk.seq.length = chunk.end
        chunk.seq.prefill_tokens = []
    plan = h.scheduler.schedule()
    assert plan.num_decoding == 3
    assert [(c.seq.request_id, c.row, c.end, c.last) for c in plan.chunks] == [("d", 3, 40, True)]
    assert h.scheduler.admit_ahead(max_tokens=100, max_chunk_tokens=16) == []  # "e": no row left


def test_a_step_riding_ahead_admits_only_beside_a_prompt_in_progress():
    """schedule(admit=False), the engine's step when a decode queued ahead has room for prompts:
    waiting requests stay queued for admit_ahead, unless the step prefills a prompt in progress
    anyway; then they join that pass as they would have."""
    h = Harness(slots=4, blocks=16, chunk=4)
    h.add("a", 10)
    assert [(c.seq.request_id, c.end, c.last) for c in h.run_plan().chunks] == [("a", 4, False)]
    h.add("b", 6)
    assert [(c.seq.request_id, c.end, c.last) for c in h.run_plan(admit=False).chunks] == [("a", 8, False)]
    assert [(c.seq.request_id, c.end, c.last) for c in h.run_plan(admit=False).chunks] == [
        ("a", 10, True), ("b", 2, False)]
    h.add("c", 3)
    assert [(c.seq.request_id, c.end, c.last) for c in h.run_plan(admit=False).chunks] == [("b", 6, True)]
    plan = h.run_plan(admit=False)
    assert plan.num_decoding == 2 and plan.chunks == []
    assert [s.request_id for s in h.scheduler.waiting] == ["c"]
    assert [c.seq.request_id for c in h.scheduler.admit_ahead(max_tokens=100, max_chunk_tokens=16)] == ["c"]
    assert [s.request_id for s in h.scheduler.running] == ["a", "b", "c"]


def test_waiting_prompts_join_the_pass_of_a_prompt_in_progress_when_riding_ahead():
    h = Harness(slots=4, blocks=16)
    h.add("a", 5)
    h.run_plan()
    for request_id, n in (("d", 40), ("e", 3)):
        h.add(request_id, n)
    assert h.scheduler.admit_ahead(max_tokens=100, max_chunk_tokens=16) == []  # "d" is too long to ride
    plan = h.scheduler.schedule(admit=False)
    assert [(c.seq.request_id, c.end, c.last) for c in plan.chunks] == [("d", 40, True), ("e", 3, True)]


def test_admit_ahead_keeps_to_the_token_budget():
    h = Harness(slots=4, blocks=16)
    for request_id, n in (("a", 10), ("b", 10)):
        h.add(request_id, n)
    chunks = h.scheduler.admit_ahead(max_tokens=15, max_chunk_tokens=16)
    assert [c.seq.request_id for c in chunks] == ["a"]
    assert h.scheduler.prefilling.request_id == "b"  # over what is left of the budget: prefilled next step
