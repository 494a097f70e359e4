"""The garbage collector and a loaded model's objects."""

from __future__ import annotations

import gc


def freeze_loaded_objects() -> None:
    """Collect the loading's garbage, then move every object left (imports, tokenizer, model, caches
    built at startup: ~0.5 M in an API worker) out of the collector's reach. Otherwise each full
    collection walks them all: a 150-350 ms pause of the event loop or of the engine thread, several
    times a minute under load (docs/benchmarks/engine.md, session 11). They live until exit anyway."""
    gc.collect()
    gc.freeze()
