"""An engine that costs nothing: the surface of worker.engine.Engine (add / step / cancel / has_work / wakeup) with
no model behind it. A test double, never a product mode: bench/zero_worker.py runs the queue benchmark's worker on it,
and the runner's tests drive the engine loop with it.

Each step emits one fixed token for every running sequence and ends a sequence at its max_tokens; a cancel ends it
at the next step.
"""

from __future__ import annotations

import threading

from worker.engine import Finish, Output, Sequence


class ZeroEngine:
    device = "none (zero-cost test double)"

    def __init__(self, token_id: int):
        self.token_id = token_id
        self.wakeup = threading.Event()
        self.running: list[Sequence] = []
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()

    def add(self, seq: Sequence) -> None:
        with self._lock:
            self._inbox.append(seq)
        self.wakeup.set()

    def cancel(self, seq_id: str) -> None:
        with self._lock:
            self._cancels.add(seq_id)
        self.wakeup.set()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.running or self._inbox or self._cancels)

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
