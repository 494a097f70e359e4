"""ConstraintStage with a fill begun ahead (overlapped steps), before the draw reached the host:
each row's token is committed once, and the masks reach the rows the sequences hold at the next
step, after some left and others joined; a step without a fill begun ahead commits the tokens the
engine left uncommitted."""

from __future__ import annotations

import threading

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


def masks_by_row(stage: ConstraintStage, running: list[Sequence]) -> dict[int, torch.Tensor]:
    fill = stage.begin(running)
    device_masks = stage.masks(fill, running, None)
    assert device_masks is not None
    masks, rows = device_masks
    assert sorted(rows.tolist()) == list(range(len(running)))  # every constrained row, once
    return {row: masks[j] for j, row in enumerate(rows.tolist())}


def test_masks_begun_ahead_follow_their_sequences_to_their_new_rows() -> None:
    stage = ConstraintStage(MaskPostProcessor(BYTES, max_batch_size=3, num_threads=2), False, torch.device("cpu"))
    stage.start()
    try:
        a, b, c = sequence("a", "ab+c"), sequence("b", "[0-9]x"), sequence("c", "(yes|no)!")
        running = [a, b, c]
        masks_by_row(stage, running)  # the first step: nothing sampled yet
        drawn = threading.Event()  # the draw is still on the device when the fill is begun

        def read_tokens() -> list[int]:
            assert drawn.wait(10)
            return [ord("a"), ord("7"), ord("n")]

        assert stage.begin_ahead(running, read_tokens)
        drawn.set()  # begin_ahead did not wait for it
        # Meanwhile `a` finished, `c` moved into its row and `d` joined without a token.
        d = sequence("d", "z+")
        running = [c, b, d]
        masks = masks_by_row(stage, running)
        for row, seq in enumerate(running):
            assert seq.request.constraint.error is None
            assert torch.equal(masks[row], llguidance_mask(seq.request.constraint.matcher))
        expected_next = {0: {ord("o")}, 1: {ord("x")}, 2: {ord("z")}}  # "n" and "7" committed once each
        for row, tokens in expected_next.items():
            assert allowed_tokens(masks[row]) == tokens
        # A step with nothing begun ahead commits what the engine left uncommitted.
        c.uncommitted_token, b.uncommitted_token, d.uncommitted_token = ord("o"), ord("x"), ord("z")
        masks = masks_by_row(stage, running)
        assert torch.equal(masks[0], llguidance_mask(c.request.constraint.matcher))
        assert allowed_tokens(masks[0]) == {ord("!")}
        assert all(seq.uncommitted_token is None for seq in running)
    finally:
        stage.shutdown()


def test_nothing_is_begun_ahead_while_a_row_fast_forwards() -> None:
    stage = ConstraintStage(MaskPostProcessor(BYTES, max_batch_size=2, num_threads=2), True, torch.device("cpu"))
    stage.start()
    try:
        a = sequence("a", "ab+c")
        a.fast_forward = True  # its commits happen on the engine thread, with its forced tokens
        assert not stage.begin_ahead([a], lambda: [ord("a")])
        mask = masks_by_row(stage, [a])[0]  # "a" not committed: the start state's mask
        assert allowed_tokens(mask) == {ord("a")}
    finally:
        stage.shutdown()


def test_a_failed_step_leaves_no_fill_begun_ahead_behind() -> None:
    stage = ConstraintStage(MaskPostProcessor(BYTES, max_batch_size=2, num_threads=2), False, torch.device("cpu"))
    stage.start()
    try:
        a = sequence("a", "ab+c")
        masks_by_row(stage, [a])

        def failed_draw() -> list[int]:
            raise RuntimeError("the device failed")

        assert stage.begin_ahead([a], failed_draw)
        stage.discard_ahead()  # the engine's step failed: every running sequence ended with it
        b = sequence("b", "[0-9]x")
        mask = masks_by_row(stage, [b])[0]  # masks_by_row asserts the fill did not fail
        assert allowed_tokens(mask) == {ord(d) for d in "0123456789"}
    finally:
        stage.shutdown()
