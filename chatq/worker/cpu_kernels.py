"""chatq's C++ kernels for a decode step on CPU (cpu_kernels.cpp): attention over the context rows, RMSNorm, the
rotary embedding and LoRA adapters' products.

torch has no decode attention for CPU that reads a step's few queries at the memory's speed, and at a decode step's
few rows its small operations cost more to dispatch than to run (docs/performance.md). The kernels are compiled with
the host's C++ compiler the first time for each kind of CPU, source and torch, then loaded from torch's extension
cache (TORCH_EXTENSIONS_DIR). Each is checked once against what it replaces; where the build or a check fails, the
forward pass keeps torch's own operations.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Built for the CPU it runs on (-march=native), so each kind of CPU gets a build of its own in the extension cache.
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno"]
# Lets the compiler sum a dot product's lanes in any order, which vectorizing it takes.
FLAGS += ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]

DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (64, 128)  # attention's builds
# Off by more than this from what a kernel replaces, it is not used: bf16's rounding stays far below it.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# A build no process has loaded for this long is for a source, torch or CPU that is gone: it is deleted.
UNUSED_FOR_S = 30 * 86400


def _build_name() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    key = f"{platform.machine()} {flags} {FLAGS} {torch.__version__}".encode() + SOURCE.read_bytes()
    return f"chatq_{hashlib.sha256(key).hexdigest()[:12]}"


def _build_root() -> Path:
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


@contextlib.contextmanager
def _alone_in(directory: Path) -> Iterator[None]:
    """Holds the build directory against other processes. torch's own lock there is a file, which a process killed
    while building leaves behind and on which every later build waits forever; an flock goes with the process holding
    it, so its holder knows that torch's lock, if any, is such a leftover."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "chatq.lock", "w") as held:
        os.utime(held.fileno())  # when a process last used this build, for _prune_unused
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def _prune_unused(root: Path, now: float) -> None:
    """Deletes the builds under root that no process has loaded for UNUSED_FOR_S, skipping any held."""
    for directory in root.glob("chatq_*"):
        lock = directory / "chatq.lock"
        with contextlib.suppress(OSError), open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if now - lock.stat().st_mtime > UNUSED_FOR_S:
                shutil.rmtree(directory)


@functools.cache
def load() -> Any | None:
    """The built kernels, their attention checked against SDPA; None where they cannot be built."""
    try:
        import ninja
        from torch.utils import cpp_extension

        # torch runs `ninja` from PATH; the ninja wheel puts it beside this interpreter, off PATH in a venv not
        # activated.
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        name = _build_name()
        directory = _build_root() / name
        with _alone_in(directory):
            kernels = cpp_extension.load(
                name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(directory)
            )
        _prune_unused(directory.parent, time.time())
        agrees = all(_attention_error(kernels, dtype) < TOLERANCE[dtype] for dtype in DTYPES)
    except Exception as e:
        log.warning("chatq's CPU kernels are not available (%s): the forward pass uses torch's operations", e)
        return None
    if not agrees:
        log.error("chatq's CPU attention kernel disagrees with SDPA: the forward pass uses torch's operations")
        return None
    return kernels


def attention_runs(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the attention kernel is built for this head size and dtype."""
    return head_dim in HEAD_DIMS and dtype in DTYPES


def _attention_error(kernels: Any, dtype: torch.dtype) -> float:
    """The largest difference from SDPA on rows of random keys, with grouped heads and uneven lengths, at each built
    head size."""
    errors = []
    for head_dim in HEAD_DIMS:
        gen = torch.Generator().manual_seed(0)
        k, v = (torch.randn(3, 2, 40, head_dim, generator=gen).to(dtype) for _ in range(2))
        q, k_new, v_new = (torch.randn(2, h, head_dim, generator=gen).to(dtype) for h in (6, 2, 2))
        rows, lens = torch.tensor([2, 0]), torch.tensor([33, 1])
        got = kernels.attend(q, k_new, v_new, k.clone(), v.clone(), rows, lens, 0.125).float()
        for j in range(2):
            k[rows[j], :, lens[j] - 1], v[rows[j], :, lens[j] - 1] = k_new[j], v_new[j]
            kj, vj = (x[rows[j], :, : lens[j]].float() for x in (k, v))
            want = F.scaled_dot_product_attention(q[j].float().view(2, 3, head_dim), kj, vj, scale=0.125)
            errors.append(float((got[j] - want.view(6, head_dim)).abs().max()))
    return max(errors)


def computes_norm(kernels: Any, norm: nn.Module, width: int, dtype: torch.dtype) -> bool:
    """Whether rms_norm computes what this model's norm module does (an RMSNorm with `variance_epsilon`, weights
    used as they are)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if dtype not in DTYPES or not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
        return False
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    return _close(kernels.rms_norm(x, weight.detach(), eps), norm(x), dtype)


def computes_rotary(
    kernels: Any, rotary: nn.Module, apply_rotary: Callable, shape: tuple[int, int, int], dtype
) -> bool:
    """Whether rotary computes what this model's apply_rotary_pos_emb does (transformers' rotate_half form) with the
    cos and sin its rotary embedding module gives. shape: (heads, KV heads, head_dim)."""
    heads, kv_heads, head_dim = shape
    if dtype not in DTYPES:
        return False
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(5, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads))
    cos, sin = rotary(q, torch.tensor([[0, 1, 7, 300, 4000]]))
    cos, sin = cos[0], sin[0]
    want_q, want_k = apply_rotary(q, k, cos, sin, unsqueeze_dim=1)
    kernels.rotary(q, k, cos, sin)
    return _close(q, want_q, dtype) and _close(k, want_k, dtype)


def computes_lora(kernels: Any, dtype: torch.dtype) -> bool:
    """Whether lora computes what the products it replaces do (chatq.worker.lora), on runs of rows of two slots
    among rows of none."""
    if dtype not in DTYPES:
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 24, generator=gen).to(dtype)
    store = torch.randn(3, 24 * 8 + 4 * 10 + 4 * 6, generator=gen).to(dtype)  # each slot's matrices side by side
    a = store[:, : 24 * 8].unflatten(1, (24, 8))
    b = [store[:, 24 * 8 : 24 * 8 + 40].unflatten(1, (4, 10)), store[:, 24 * 8 + 40 :].unflatten(1, (4, 6))]
    runs = [(1, 0, 3), (2, 4, 9)]
    got = [torch.full((9, out), float("nan"), dtype=dtype) for out in (10, 6)]
    kernels.lora(x, a, b, got, torch.tensor(runs))
    for slot, begin, end in runs:
        low = x[begin:end].float() @ a[slot].float()
        for m, delta in enumerate(got):
            want = low[:, m * 4 : (m + 1) * 4] @ b[m][slot].float()
            if not _close(delta[begin:end], want.to(dtype), dtype):
                return False
    return bool((got[0][3] == 0).all())


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    got, want = got.float(), want.float()
    return got.shape == want.shape and bool(((got - want).abs() <= TOLERANCE[dtype] * (1 + want.abs())).all())
