"""freeze_loaded_objects: the loading's garbage is collected, what is left is out of the collector's reach."""

from __future__ import annotations

import gc
import weakref

from llgtrt_core.heap import freeze_loaded_objects


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
