"""The collector in a loaded process: the loading's garbage collected, the rest frozen out of its reach, and the
engine process's young generation collected less often."""

from __future__ import annotations

import gc
import weakref

from llgtrt_core.heap import collect_young_less_often, freeze_loaded_objects


class _Node:
    pass


def test_garbage_is_collected_and_the_rest_frozen() -> None:
    kept, cycle = _Node(), _Node()
    cycle.self = cycle  # garbage only a collection frees
    gone = weakref.ref(cycle)
    del cycle
    try:
        freeze_loaded_objects()
        assert gone() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # out of every generation's reach
    finally:
        gc.unfreeze()


def test_the_young_threshold_rises_and_the_older_ones_stay() -> None:
    before = gc.get_threshold()
    try:
        collect_young_less_often(12_345)
        assert gc.get_threshold() == (12_345, before[1], before[2])
    finally:
        gc.set_threshold(*before)
