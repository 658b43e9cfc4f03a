"""An engine that costs nothing: the surface of chatq.worker.engine.Engine (add / step / cancel / has_work /
wakeup) with no model behind it. A test double, never a product mode: bench/zero_worker.py runs the queue
benchmark's worker on it, and the runner's tests drive the engine loop with it.

Each step emits one fixed token for every running sequence and ends a sequence at its max_tokens; a cancel ends it
at the next step.
"""

from __future__ import annotations

import threading

import torch

from chatq.worker.engine import Engine, Finish, Output, Sequence


class ZeroEngine(Engine):
    """The real engine's add, cancel and has_work (its intake from other threads), with a step of its own. It sets up
    only what those use instead of calling Engine.__init__, which would build a model's cache."""

    def __init__(self, token_id: int):
        self.token_id = token_id
        self.device = torch.device("cpu")
        self.wakeup = threading.Event()
        self.urgent = threading.Event()
        self.waiting = []
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()
        self.checks = []

    @property
    def mode(self) -> str:
        return "zero"

    def step(self) -> list[Output]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        self.running.extend(inbox)
        outputs = []
        kept = []
        for seq in self.running:
            if seq.id in cancels:
                seq.finish = Finish.cancelled
                outputs.append(Output(seq=seq, token=None, finish=Finish.cancelled))
                continue
            seq.output_ids.append(self.token_id)
            finish = Finish.length if len(seq.output_ids) >= seq.params.max_tokens else None
            seq.finish = finish
            outputs.append(Output(seq=seq, token=self.token_id, finish=finish))
            if finish is None:
                kept.append(seq)
        self.running = kept
        return outputs
