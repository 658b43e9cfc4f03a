"""The HTTP API's application: one Redis pool, the job store, the relay and the served model, behind the routes."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from chatq.api import errors, metrics
from chatq.api.admission import ServedModel
from chatq.api.auth import Keys
from chatq.api.jobs import JobStore
from chatq.api.relay import Relay
from chatq.api.routes import Service, open_router, router
from chatq.core import collector
from chatq.core.queue import make_celery
from chatq.core.settings import Settings


def redis_client(settings: Settings) -> aioredis.Redis:
    # Many requests may wait on Redis at once (submits, each new stream's log read): the pool grows with them
    # rather than queueing them behind a small cap.
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        decode_responses=True,
        max_connections=10_000,
        timeout=None,
        # A command whose connection failed is sent again on a new one: after Redis restarts, every pooled one is stale.
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
    )
    return aioredis.Redis(connection_pool=pool)


def create_app(settings: Settings) -> FastAPI:
    client = redis_client(settings)
    store = JobStore(client, make_celery(settings), settings)
    service = Service(settings, client, store, Relay(client, settings.redis_url), ServedModel(settings))
    api_keys = Keys(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        api_keys.warn_if_open()
        collector.settle()
        yield
        await client.aclose()
        gc.unfreeze()

    app = FastAPI(title="chatq", lifespan=lifespan)
    app.state.service = service
    app.state.keys = api_keys
    # The app's own registry, not the global one: each app counts its own requests (tests build several).
    app.state.metrics_registry = registry = CollectorRegistry()
    app.add_middleware(metrics.HTTPMetrics, requests=metrics.http_counter(registry))
    app.include_router(router)
    app.include_router(open_router)
    # Open, as /health is and vLLM's is: scrapers rarely hold an API key, and it shows counts, never content.
    app.include_router(metrics.router)
    errors.install(app)
    return app


def app_from_env() -> FastAPI:
    """Entry point for uvicorn (`uvicorn --factory chatq.api.app:app_from_env`)."""
    return create_app(Settings())
