"""When a job's moments happened, for the per-request metrics its last write adds (chatq.core.metrics).

Wall-clock times: the submission is stamped by the API, on another host perhaps, and the rest here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from chatq.core.metrics import ITL, JobFacts, Tally


@dataclass
class JobClock:
    submitted: float  # the API's submit
    entered: float  # when it last entered the queue: its submit, or its requeue for a job continued from a log
    started: float  # this worker's claim
    resumed: bool = False  # an earlier attempt sent the first token
    first_token: float | None = None
    itl: Tally = field(default_factory=lambda: Tally(ITL))
    _last_token: dict[int, float] = field(default_factory=dict)  # by choice

    @classmethod
    def starting(cls) -> JobClock:
        now = time.time()
        return cls(now, now, now)

    @classmethod
    def from_record(cls, record: Mapping[str, str], resumed: bool) -> JobClock:
        """The clock of a job just claimed, from its record: `submitted` (set at submit; a record written before it
        existed gives `created`, whole seconds), `queued_at`, and the claim's `started`."""
        started = float(record.get("started") or time.time())
        submitted = float(record.get("submitted") or record.get("created") or started)
        entered = float(record.get("queued_at") or submitted) if resumed else submitted
        return cls(submitted, entered, started, resumed)

    def token(self, choice: int, now: float) -> None:
        """A token of `choice` came out of the step that ended at `now`."""
        last = self._last_token.get(choice)
        if last is not None:
            self.itl.add(now - last)
        elif self.first_token is None:
            self.first_token = now
        self._last_token[choice] = now

    def facts(self, now: float, prompt_tokens: int, generation_tokens: int, finished_reason: str) -> JobFacts:
        ttft = None if self.resumed or self.first_token is None else self.first_token - self.submitted
        return JobFacts(
            e2e=now - self.submitted,
            queue_time=self.started - self.entered,
            ttft=ttft,
            itl=self.itl,
            prompt_tokens=prompt_tokens,
            generation_tokens=generation_tokens,
            finished_reason=finished_reason,
        )
