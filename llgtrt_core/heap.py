"""The garbage collector and a loaded model's objects."""

from __future__ import annotations

import gc

# The engine process's young-generation threshold (CPython's default: 700 container objects made and
# not yet freed). A step at batch 256 holds more than 700 for a while (each row's delta; with
# constraints, the constraint stage's rows and llguidance's argument tuples), so at the default a
# collection, which stops every thread of the process, ran in most json_schema steps
# (docs/benchmarks/engine.md, session 24).
ENGINE_YOUNG_THRESHOLD = 10_000


def freeze_loaded_objects() -> None:
    """Collect the loading's garbage, then move every object left (imports, tokenizer, model, caches
    built at startup: ~0.5 M in an API worker) out of the collector's reach. Otherwise each full
    collection walks them all: a 150-350 ms pause of the event loop or of the engine thread, several
    times a minute under load (docs/benchmarks/engine.md, session 11). They live until exit anyway."""
    gc.collect()
    gc.freeze()


def collect_young_less_often(threshold: int = ENGINE_YOUNG_THRESHOLD) -> None:
    """Collect the young generation once `threshold` container objects are alive since the last
    collection (the older generations' thresholds, which count collections, are kept)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(threshold, middle, old)
