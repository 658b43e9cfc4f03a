"""The API's periodic dispatch of parked jobs (chatq.core.fair). A job's end fills the slot it frees, but slots also
free without one (a worker that starts, a dead worker's jobs handed on), and nothing else would fill those."""

from __future__ import annotations

import asyncio
import logging
import time

from chatq.api.routes import Service
from chatq.core import fair

log = logging.getLogger(__name__)

EVERY = 1.0  # seconds between two dispatches of every model


async def dispatching(svc: Service) -> None:
    """Dispatches every live model's parked jobs into free slots, every EVERY seconds, for as long as the API runs."""
    while True:
        await asyncio.sleep(EVERY)
        try:
            for model, _ in await svc.models.live():
                await fair.dispatch(svc.redis, model.name, time.time(), svc.settings.worker_ttl)
        except Exception as e:  # Redis out of reach: the next round tries again
            log.warning("dispatching parked jobs failed: %r", e)
