"""A batch line's place in its worker's engine, apart from the queue's lanes (chatq.core.queue): the engine runs
where the queue's packages may not be installed (bench/gpu_engine.py)."""

from __future__ import annotations

# Added to a batch line's `priority` in its worker's engine: any other sequence waiting there is admitted first, a
# batch line is preempted first, and a step of batch lines alone gives way to any other (docs/engine.md).
BATCH_ENGINE_PRIORITY = 1 << 20


def is_batch_line(engine_priority: int) -> bool:
    """Whether a request's priority, as its worker's engine sees it, is a batch line's."""
    return engine_priority >= BATCH_ENGINE_PRIORITY
