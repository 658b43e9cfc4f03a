"""Waiting for replicas to have a write (Redis' WAIT), so that a failover to one of them loses none of what chatq
acknowledged: a job the API accepted, a step a stream showed."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from chatq.core.settings import Settings

log = logging.getLogger(__name__)

# Seconds waiting is left off once replicas did not acknowledge in time (one is down, or resyncing): meanwhile
# writes go at the master's pace instead of each waiting out the timeout.
PAUSE = 10.0


@dataclass
class ReplicaWait:
    replicas: int
    timeout: float  # seconds
    _paused_until: float = 0.0

    @classmethod
    def of(cls, settings: Settings) -> ReplicaWait:
        return cls(settings.wait_replicas, settings.redis_wait_timeout)

    def command(self) -> tuple[str, int, int] | None:
        """The WAIT to send, on the connection that made the writes (WAIT waits only for its own); None: none."""
        if self.replicas == 0 or time.monotonic() < self._paused_until:
            return None
        return ("WAIT", self.replicas, max(1, round(self.timeout * 1000)))

    def acknowledged(self, count: int) -> None:
        """What WAIT answered: the replicas that have the writes."""
        if count < self.replicas:
            self._paused_until = time.monotonic() + PAUSE
            log.warning(
                "%d of %d Redis replicas took a write within %.2f s; not waiting for them for %.0f s",
                count,
                self.replicas,
                self.timeout,
                PAUSE,
            )
