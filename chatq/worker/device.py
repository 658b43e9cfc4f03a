"""The worker's accelerator: the engine's thread pinned to it, and whether its context still works.

On CUDA, kernels launch on the thread's current device: a worker on `cuda:1` whose engine thread kept device 0
would run Triton's kernels and capture its graphs there. A fault such as an illegal address or a device-side assert
leaves the context unusable for the rest of the process: every later call fails at once, so such a worker must stop
rather than take jobs and fail each one.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class DeviceLost(RuntimeError):
    """The GPU's context is gone; nothing more can run on it in this process."""


def bind(device: torch.device) -> None:
    """Makes `device` the current one of the calling thread (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def lost(device: torch.device) -> bool:
    """Whether `device`'s context no longer works: a synchronize and a small computation both must succeed."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() != 2.0
    except Exception:
        log.exception("the CUDA context of %s no longer works", device)
        return True
