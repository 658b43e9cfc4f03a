"""Sending again what Redis cannot take for now, waiting 0.1 s, then twice as long each time, up to 2 s."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

T = TypeVar("T")

# Unreachable, out of memory until results expire, failing over, busy in a script, or refusing writes after a
# failed save. Anything else (a wrong-type key, say) will never be taken.
TRANSIENT = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
)
# redis-py has no class for these, and wraps an error inside a transaction ("Command # 3 (SREM ...) of pipeline
# caused error: MISCONF ..."), so the code is matched anywhere.
TRANSIENT_CODES = re.compile(r"\b(MISCONF|BUSY|NOREPLICAS|LOADING|OOM|READONLY|MASTERDOWN|TRYAGAIN)\b")
FIRST_DELAY, MAX_DELAY = 0.1, 2.0


def transient(error: BaseException) -> bool:
    """Whether Redis may take the same command later."""
    return isinstance(error, TRANSIENT) or (
        isinstance(error, redis.ResponseError) and TRANSIENT_CODES.search(str(error)) is not None
    )


class Retry:
    """Runs a command until Redis takes it or refuses it for good (then the error is raised).

    Each wait is logged as `what`, at most once per `warn_every` seconds among all the commands that share this
    object, so an outage met by hundreds of streams is one warning.
    """

    def __init__(self, log: logging.Logger, what: str, warn_every: float = 0.0):
        self.log = log
        self.what = what
        self.warn_every = warn_every
        self._warned_at = -float("inf")

    def run(self, command: Callable[[], T], stop: threading.Event | None = None) -> T:
        """Blocking; once `stop` is set, the next refusal is raised instead of waited out."""
        delay = FIRST_DELAY
        while True:
            try:
                return command()
            except Exception as e:
                if not transient(e) or (stop is not None and stop.is_set()):
                    raise
                self._waiting(e, delay)
                if stop is None:
                    time.sleep(delay)
                else:
                    stop.wait(delay)
                delay = min(2 * delay, MAX_DELAY)

    async def arun(self, command: Callable[[], Awaitable[T]]) -> T:
        delay = FIRST_DELAY
        while True:
            try:
                return await command()
            except Exception as e:
                if not transient(e):
                    raise
                self._waiting(e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_DELAY)

    def _waiting(self, error: BaseException, delay: float) -> None:
        now = time.monotonic()
        if now - self._warned_at >= self.warn_every:
            self._warned_at = now
            self.log.warning("%s (%s); trying again in %.1f s", self.what, error, delay)
