"""LoRA adapters in the worker: read from their files into memory (`Library`), a few of them held by the forward pass
at once (`Resident`), and the low-rank products of every row of a step, whatever its adapter, done together.

Each slot holds one adapter, its rank padded to the largest taken; slot 0 holds zeros, for the rows of the base model.
Per layer, the modules that read the same input (q, k, v; gate, up) share one A, so each group of modules takes one
product by A and one by each module's B for all the step's rows, whatever the mix of adapters, and no row is multiplied
by an adapter not its own. On CPU, chatq's kernel (cpu_kernels.cpp) takes each run of one adapter's rows (the engine
puts them side by side) in one call a group; elsewhere the step's rows are gathered by slot into a [slots, rows,
features] block for two batched products (`Rows`), a block a CUDA graph holds at a fixed size, its whole batch wide.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from chatq.core import lora_format
from chatq.core.lora_format import LoraSpec
from chatq.worker import cpu_kernels

if TYPE_CHECKING:  # the engine runs without the service's packages (pydantic), which its record is
    from chatq.core.adapters import Adapter

# The modules that read the same input, whose products are taken together, by name.
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class Layout:
    """Where a slot's pairs sit in its row of the resident store: per layer, each group's A [in, modules * rank]
    and each module's B [rank, out], at their offsets; ranks padded to the largest taken."""

    groups: dict[str, list[str]]
    rank: int
    a: list[dict[str, tuple[int, int, int]]]  # [layer] group -> (offset, in, modules * rank)
    b: list[dict[str, tuple[int, int, int]]]  # [layer] module -> (offset, rank, out)
    size: int


def layout_of(spec: LoraSpec) -> Layout:
    groups = {g: [m for m in ms if m in spec.shapes] for g, ms in GROUPS.items()}
    groups = {g: ms for g, ms in groups.items() if ms}
    r, at = spec.max_rank, 0
    a: list[dict[str, tuple[int, int, int]]] = []
    b: list[dict[str, tuple[int, int, int]]] = []
    for _ in range(spec.layers):
        a.append({})
        for g, ms in groups.items():
            a[-1][g] = (at, spec.shapes[ms[0]][0], len(ms) * r)
            at += spec.shapes[ms[0]][0] * len(ms) * r
        b.append({})
        for m, (_, out) in spec.shapes.items():
            b[-1][m] = (at, r, out)
            at += r * out
    return Layout(groups, r, a, b, at)


def part(row: torch.Tensor, where: tuple[int, int, int]) -> torch.Tensor:
    """One matrix of a slot's row (the last dimension of `row`) as a view."""
    at, rows, cols = where
    return row[..., at : at + rows * cols].unflatten(-1, (rows, cols))


@dataclass(frozen=True)
class Weights:
    """One load of an adapter, in memory: its pairs laid out as a slot's row of the resident store (`Layout`), so
    swapping it in is one copy."""

    id: str
    name: str
    rank: int
    row: torch.Tensor


def read(adapter: Adapter, spec: LoraSpec, dtype: torch.dtype) -> Weights:
    """The adapter's weights, checked as the API checked them (AdapterInvalid, if its files changed since)."""
    from safetensors.torch import load_file

    config = lora_format.check(adapter.path, spec, adapter.base)
    layout = layout_of(spec)
    row = torch.zeros(layout.size, dtype=dtype)
    with torch.inference_mode():
        for name, tensor in load_file(f"{adapter.path}/{lora_format.WEIGHTS}").items():
            found = lora_format.tensor_of(name)
            assert found is not None  # check() refused any other tensor
            layer, module, half = found
            if half == "B":
                part(row, layout.b[layer][module])[: config.rank].copy_(tensor.T.float() * config.scaling)
                continue
            group = next(g for g, ms in layout.groups.items() if module in ms)
            m = layout.groups[group].index(module)
            part(row, layout.a[layer][group])[:, m * layout.rank : m * layout.rank + config.rank].copy_(tensor.T)
    return Weights(adapter.id, adapter.name, config.rank, row)


class Library:
    """The adapters this worker has read, by load id, the least recently used dropped past `capacity`. Read on the
    threads that submit jobs, so the engine's thread never waits for a disk."""

    def __init__(self, spec: LoraSpec, dtype: torch.dtype, capacity: int):
        self.spec = spec
        self.dtype = dtype
        self.capacity = capacity
        self._lock = threading.Lock()
        self._read: OrderedDict[str, Weights] = OrderedDict()

    def get(self, adapter: Adapter) -> Weights:
        with self._lock:
            if (found := self._read.get(adapter.id)) is not None:
                self._read.move_to_end(adapter.id)
                return found
        weights = read(adapter, self.spec, self.dtype)  # outside the lock: another job's adapter need not wait
        with self._lock:
            self._read[adapter.id] = weights
            while len(self._read) > self.capacity:
                self._read.popitem(last=False)
        return weights


@dataclass
class Rows:
    """A step's tokens by adapter slot: slots first..first+count-1, `width` places each (the last padded with any
    token, whose products nobody reads)."""

    take: torch.Tensor  # [count * width] the token at each place
    back: torch.Tensor  # [T] each token's place
    first: int
    count: int
    width: int
    slots: list[int]  # [T] each token's slot in the stack
    runs: torch.Tensor  # [K, 3] on the host: (slot, first token, end) of each run of one adapter's tokens


def rows_of(slots: list[int], device: torch.device, width: int = 0, everything: int = 0) -> Rows:
    """The places of tokens in these stack slots (0: the base model). `width` and `everything` (the number of slots)
    fix the block's shape, as a CUDA graph needs; by default it spans the slots in use, as wide as the largest."""
    by_slot: dict[int, list[int]] = {}
    for t, s in enumerate(slots):
        by_slot.setdefault(s, []).append(t)
    first, last = (0, everything - 1) if everything else (min(by_slot), max(by_slot))
    width = width or max(len(ts) for ts in by_slot.values())
    take, back = [0] * ((last - first + 1) * width), [0] * len(slots)
    for s, ts in by_slot.items():
        base = (s - first) * width
        take[base : base + len(ts)] = ts
        for i, t in enumerate(ts):
            back[t] = base + i
    runs, t = [], 0
    for s, same in itertools.groupby(slots):
        n = len(list(same))
        if s:  # slot 0, the base model's, has no products to make
            runs.append((s, t, t + n))
        t += n
    as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
    runs_tensor = torch.tensor(runs, dtype=torch.long).view(-1, 3)
    return Rows(as_tensor(take), as_tensor(back), first, last - first + 1, width, slots, runs_tensor)


class Resident:
    """The adapters the forward pass holds: `max_loras` of them, of ranks up to `max_rank`, swapped in as sequences
    need them. One store [1 + slots, layout size], in place (a CUDA graph reads there); per layer, each group's A
    [1 + slots, in, modules * rank] and each module's B [1 + slots, rank, out] are views of it."""

    def __init__(self, spec: LoraSpec, dtype: torch.dtype, device: torch.device, kernels: Any = None):
        """`kernels`: chatq's CPU kernels (cpu_kernels), whose lora then makes a CPU step's products."""
        self.spec, self.device = spec, device
        self.kernel = kernels.lora if kernels is not None and cpu_kernels.computes_lora(kernels, dtype) else None
        self.slots, self.rank = spec.max_loras, spec.max_rank
        self.ids: list[str | None] = [None] * self.slots
        self.order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(self.slots))  # least recent first
        self.layout = layout_of(spec)
        self.groups = self.layout.groups
        self.store = torch.zeros(1 + self.slots, self.layout.size, dtype=dtype, device=device)
        self.a = [{g: part(self.store, where) for g, where in layer.items()} for layer in self.layout.a]
        self.b = [{m: part(self.store, where) for m, where in layer.items()} for layer in self.layout.b]

    def slot_for(self, weights: Weights, busy: set[int]) -> int | None:
        """The slot holding `weights`, swapping them in for the least recently used adapter no running sequence
        needs (`busy`); None while every slot is busy."""
        if weights.id in self.ids:
            slot = self.ids.index(weights.id)
        else:
            free = [s for s in self.order if s not in busy]
            if not free:
                return None
            slot = free[0]
            self._place(slot, weights)
        self.order.move_to_end(slot)
        return slot

    @torch.inference_mode()
    def _place(self, slot: int, weights: Weights) -> None:
        self.store[1 + slot].copy_(weights.row)
        self.ids[slot] = weights.id

    def rows(self, slots: list[int]) -> Rows:
        """The gathering of a step whose tokens run with these slots (-1: the base model)."""
        return rows_of([1 + s for s in slots], self.device)

    def fixed_rows(self, rows: Rows, width: int) -> Rows:
        """The same tokens, and padding up to `width`, in a block of every slot `width` wide: a CUDA graph's."""
        padded = rows.slots + [0] * (width - len(rows.slots))
        return rows_of(padded, self.device, width, 1 + self.slots)


@dataclass
class LayerDeltas:
    """One layer's low-rank products for a step: its groups' deltas, called as the forward pass reaches them."""

    resident: Resident
    rows: Rows
    layer: int

    def __call__(self, group: str, x: torch.Tensor) -> list[torch.Tensor]:
        rows, resident = self.rows, self.resident
        if resident.kernel is not None:
            modules = resident.groups[group]
            deltas = [x.new_empty(x.shape[0], resident.spec.shapes[m][1]) for m in modules]
            b = [resident.b[self.layer][m] for m in modules]
            resident.kernel(x.contiguous(), resident.a[self.layer][group], b, deltas, rows.runs)
            return deltas
        spanned = slice(rows.first, rows.first + rows.count)
        block = x.index_select(0, rows.take).view(rows.count, rows.width, -1)
        low = torch.bmm(block, resident.a[self.layer][group][spanned])  # [count, width, modules * rank]
        deltas = []
        for m, module in enumerate(resident.groups[group]):
            part = low[..., m * resident.rank : (m + 1) * resident.rank]
            out = torch.bmm(part, resident.b[self.layer][module][spanned])
            deltas.append(out.view(rows.count * rows.width, -1).index_select(0, rows.back))
        return deltas
