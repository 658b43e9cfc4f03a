"""Python's cyclic garbage collector, set for a long-running server process (the API and the workers)."""

from __future__ import annotations

import gc

# Young containers allowed to pile up before a collection. Python's 700 is crossed within one engine step or one
# burst of relayed frames by objects that are still in use (a step's events for 200 jobs), so collections ran
# constantly, found nothing (chatq makes no cyclic garbage on its hot paths) and promoted the objects they met
# until a full collection was due: ten in 26 s of 200 relayed streams, stopping the worker 33 ms each.
YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Freezes what the process built at startup and raises the young generation's threshold.

    Frozen, the objects that live as long as the process (400,000 in a worker once torch, transformers and the model
    are loaded, 80,000 in the API) are out of the collector's sight: a full collection walked them all, stopping
    every request and stream for 50-250 ms.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
