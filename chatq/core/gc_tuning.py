"""Python's cyclic garbage collector, set for a long-running server process (the API and the workers)."""

from __future__ import annotations

import gc

# Python's default is crossed by live objects within one engine step or relay burst: collections would find
# nothing (hot paths make no cycles) and promote those objects toward full collections.
YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Freezes what the process built at startup and raises the young generation's threshold.

    Frozen, the objects that live as long as the process (torch, transformers and the model, in a worker) are out
    of the collector's sight: a full collection would walk them all, stopping every request and stream.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
