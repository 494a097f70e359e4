"""ConstraintStage with a fill begun ahead (overlapped steps), before the draw reached the host:
each row's token is committed once, and the masks reach the rows the sequences hold at the next
step, after some left and others joined; a step without a fill begun ahead commits the tokens the
engine left uncommitted; a slow grammar's row, filled apart, sits a step out when its mask is late,
and keeps its mask on the way while others join and move. On CPU and on CUDA, where the device
waits for the fill (`HostGate`): the masks are read back once the gate is open."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import pytest
import torch

from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.engine.constraint_stage import ConstraintStage
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.sequence import Sequence

from test_constraints_postprocessor import BYTES, llguidance_mask, regex


def sequence(name: str, grammar: str) -> Sequence:
    request = GenerationRequest(name, [1], SamplingParams(max_tokens=8), regex(grammar))
    return Sequence(request, emit=lambda delta: None, generator=None)


def allowed_tokens(mask: torch.Tensor) -> set[int]:
    return {t for t in range(BYTES.vocab_size) if mask[t // 32] >> (t % 32) & 1}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@contextlib.contextmanager
def started_stage(max_batch_size: int, device: str, fast_forward: bool = False) -> Iterator[ConstraintStage]:
    stage = ConstraintStage(MaskPostProcessor(BYTES, max_batch_size=max_batch_size, num_threads=2), fast_forward,
                            torch.device(device))
    stage.start()
    assert stage.device_waits == (device == "cuda")  # the H100/H200 drivers let a stream wait on host memory
    try:
        yield stage
    finally:
        stage.shutdown()


def masks_by_row(stage: ConstraintStage, running: list[Sequence], may_sit_out: bool = False
                 ) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Row -> mask of one step's fill, and the rows sitting it out."""
    fill = stage.begin(running)
    device_masks, sitting_out = stage.masks(fill, running, None, lambda row: may_sit_out)
    assert device_masks is not None
    masks, rows = device_masks[0].cpu(), device_masks[1].cpu()  # on CUDA: once the gate is open
    live = [row for row in rows.tolist() if row >= 0]  # -1: a row that left since the fill began (skipped)
    assert sorted(live + sitting_out) == list(range(len(running)))  # every constrained row, once
    return {row: masks[j] for j, row in enumerate(rows.tolist()) if row >= 0}, sitting_out


def step_masks(stage: ConstraintStage, running: list[Sequence]) -> dict[int, torch.Tensor]:
    masks, sitting_out = masks_by_row(stage, running)
    assert sitting_out == []
    return masks


def test_masks_begun_ahead_follow_their_sequences_to_their_new_rows(device: str) -> None:
    with started_stage(3, device) as stage:
        a, b, c = sequence("a", "ab+c"), sequence("b", "[0-9]x"), sequence("c", "(yes|no)!")
        running = [a, b, c]
        step_masks(stage, running)  # the first step: nothing sampled yet
        drawn = threading.Event()  # the draw is still on the device when the fill is begun

        def read_tokens() -> list[int]:
            assert drawn.wait(10)
            return [ord("a"), ord("7"), ord("n")]

        assert stage.begin_ahead(running, read_tokens)
        drawn.set()  # begin_ahead did not wait for it
        # Meanwhile `a` finished, `c` moved into its row and `d` joined without a token.
        d = sequence("d", "z+")
        running = [c, b, d]
        masks = step_masks(stage, running)
        for row, seq in enumerate(running):
            assert seq.request.constraint.error is None
            assert torch.equal(masks[row], llguidance_mask(seq.request.constraint.matcher))
        expected_next = {0: {ord("o")}, 1: {ord("x")}, 2: {ord("z")}}  # "n" and "7" committed once each
        for row, tokens in expected_next.items():
            assert allowed_tokens(masks[row]) == tokens
        # A step with nothing begun ahead commits what the engine left uncommitted.
        c.uncommitted_token, b.uncommitted_token, d.uncommitted_token = ord("o"), ord("x"), ord("z")
        masks = step_masks(stage, running)
        assert torch.equal(masks[0], llguidance_mask(c.request.constraint.matcher))
        assert allowed_tokens(masks[0]) == {ord("!")}
        assert all(seq.uncommitted_token is None for seq in running)


def test_steps_whose_rows_stay_put_take_the_masks_begun_ahead_row_for_row(device: str) -> None:
    with started_stage(3, device) as stage:
        a, b, c = sequence("a", "a+b"), sequence("b", "[0-9]+x"), sequence("c", "(ab)+!")
        running = [a, b, c]
        step_masks(stage, running)
        c_tokens = "abab"
        for step, c_token in enumerate(c_tokens):  # the same rows every step, as most steps of a batch
            tokens = [ord("a"), ord("1"), ord(c_token)]
            assert stage.begin_ahead(running, lambda: tokens)
            masks = step_masks(stage, running)
            for row, seq in enumerate(running):
                assert torch.equal(masks[row], llguidance_mask(seq.request.constraint.matcher))
            assert allowed_tokens(masks[0]) == {ord("a"), ord("b")}
            assert allowed_tokens(masks[1]) == {ord(d) for d in "0123456789x"}
            # Each token committed once: after "a" only "b", after "ab" another "a" or the end.
            assert allowed_tokens(masks[2]) == ({ord("b")} if step % 2 == 0 else {ord("a"), ord("!")})
        running = [a, c]  # b ended: the rows change, and the next steps keep the new ones
        for c_token in "ab":
            assert stage.begin_ahead(running, lambda: [ord("a"), ord(c_token)])
            masks = step_masks(stage, running)
            assert [allowed_tokens(masks[row]) for row in (0, 1)] == [
                {ord("a"), ord("b")}, {ord("b")} if c_token == "a" else {ord("a"), ord("!")}]


def test_nothing_is_begun_ahead_while_a_row_fast_forwards(device: str) -> None:
    with started_stage(2, device, fast_forward=True) as stage:
        a = sequence("a", "ab+c")
        a.fast_forward = True  # its commits happen on the engine thread, with its forced tokens
        assert not stage.begin_ahead([a], lambda: [ord("a")])
        mask = step_masks(stage, [a])[0]  # "a" not committed: the start state's mask
        assert allowed_tokens(mask) == {ord("a")}


def test_a_failed_step_leaves_no_fill_begun_ahead_behind(device: str) -> None:
    with started_stage(2, device) as stage:
        a = sequence("a", "ab+c")
        step_masks(stage, [a])

        def failed_draw() -> list[int]:
            raise RuntimeError("the device failed")

        assert stage.begin_ahead([a], failed_draw)
        stage.discard_ahead()  # the engine's step failed: every running sequence ended with it
        b = sequence("b", "[0-9]x")
        mask = step_masks(stage, [b])[0]  # step_masks asserts the fill did not fail
        assert allowed_tokens(mask) == {ord(d) for d in "0123456789"}


def slow(seq: Sequence) -> Sequence:
    seq.request.constraint.mask_cost.mark_slow()  # as the compiler's probe marks a slow grammar
    return seq


def test_a_slow_grammars_row_sits_out_a_step_while_its_mask_filled_apart_is_late(device: str) -> None:
    with started_stage(3, device) as stage:
        a, s, b = sequence("a", "ab+c"), slow(sequence("s", "(yes|no)!")), sequence("b", "[0-9]x")
        running = [a, s, b]
        first = step_masks(stage, running)  # nothing sampled; the slow row's first mask, filled apart, waited for
        assert allowed_tokens(first[1]) == {ord("y"), ord("n")}
        late = threading.Event()

        def read_tokens() -> list[int]:  # the apart job's read of the draw is held up: its mask is late
            if threading.current_thread().name.startswith("mask-fill-apart"):
                assert late.wait(10)
            return [ord("a"), ord("y"), ord("7")]

        assert stage.begin_ahead(running, read_tokens)
        masks, sitting_out = masks_by_row(stage, running, may_sit_out=True)
        assert sitting_out == [1]  # the others' masks did not wait for it
        assert allowed_tokens(masks[0]) == {ord("b")} and allowed_tokens(masks[2]) == {ord("x")}
        # The next step: the rows that drew commit; the slow row keeps the mask on its way (its "y").
        assert stage.begin_ahead(running, lambda: [ord("b"), ord("n"), ord("x")])
        late.set()
        masks = step_masks(stage, running)  # may not sit out: waits for the slow row's mask
        assert allowed_tokens(masks[1]) == {ord("e")}  # "y" committed once; the dropped draw's "n" never
        assert torch.equal(masks[1], llguidance_mask(s.request.constraint.matcher))
        assert allowed_tokens(masks[0]) == {ord("b"), ord("c")} and allowed_tokens(masks[2]) == {BYTES.eos_token}


def test_a_step_waits_for_a_late_mask_rather_than_have_every_row_sit_out(device: str) -> None:
    with started_stage(2, device) as stage:
        s = slow(sequence("s", "(yes|no)!"))
        step_masks(stage, [s])
        late = threading.Event()

        def read_tokens() -> list[int]:
            assert late.wait(10)
            return [ord("n")]

        assert stage.begin_ahead([s], read_tokens)
        threading.Timer(0.2, late.set).start()
        masks, sitting_out = masks_by_row(stage, [s], may_sit_out=True)  # alone: sitting out would gain nothing
        assert sitting_out == [] and allowed_tokens(masks[0]) == {ord("o")}


def test_a_row_joins_and_another_moves_while_slow_rows_are_filled_apart(device: str) -> None:
    with started_stage(4, device) as stage:
        a, s, t, b = (sequence("a", "ab+c"), slow(sequence("s", "(yes|no)!")), slow(sequence("t", "[0-9]x")),
                      sequence("b", "q+r"))
        running = [a, s, t, b]
        step_masks(stage, running)
        late = threading.Event()

        def read_tokens() -> list[int]:  # the slow rows' job is held up: both sit the next step out
            if threading.current_thread().name.startswith("mask-fill-apart"):
                assert late.wait(10)
            return [ord("a"), ord("y"), ord("7"), ord("q")]

        assert stage.begin_ahead(running, read_tokens)
        assert masks_by_row(stage, running, may_sit_out=True)[1] == [1, 2]
        assert stage.begin_ahead(running, lambda: [ord("b"), ord("n"), ord("3"), ord("q")])
        # Meanwhile `a` and `t` finished, `b` moved into row 0 and `d` joined: `s` keeps its mask on the way.
        d = sequence("d", "z+")
        running = [b, s, d]
        late.set()
        masks = step_masks(stage, running)
        for row, seq in enumerate(running):
            assert torch.equal(masks[row], llguidance_mask(seq.request.constraint.matcher))
        assert allowed_tokens(masks[0]) == {ord("q"), ord("r")}  # "q" committed at each of the two steps
        assert allowed_tokens(masks[1]) == {ord("e")}  # "y" from its own job; the dropped draw's "n" never
        assert allowed_tokens(masks[2]) == {ord("z")}
