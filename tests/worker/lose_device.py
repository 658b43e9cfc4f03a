"""A Celery worker whose GPU is lost mid-job, for tests/worker/test_device.py: run in place of `celery`, with the
same arguments. Its forward pass number LOSE_DEVICE_AFTER + 1 fails as CUDA fails after an illegal address, and from
then on the device reports itself lost, as a CUDA context does after such a fault: a CPU cannot make the real one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from celery.__main__ import main  # noqa: E402

from chatq.worker import device, forward  # noqa: E402

AFTER = int(os.environ["LOSE_DEVICE_AFTER"])
passes = 0
original = forward.PagedForward.__call__


def failing(self, b, out=None, stop=None):
    global passes
    passes += 1
    if passes > AFTER:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return original(self, b, out, stop)


forward.PagedForward.__call__ = failing
device.lost = lambda _device: passes > AFTER

if __name__ == "__main__":
    sys.exit(main())
