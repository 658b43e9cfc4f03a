"""The HTTP API's application: one Redis pool, the job store, the relay and the served models, behind the routes."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from chatq.api import adapters, admin, batches, dispatcher, errors, files, metrics, responses
from chatq.api.auth import Keys
from chatq.api.batch_files import BatchFiles
from chatq.api.batch_runner import BatchRunner
from chatq.api.jobs import JobStore
from chatq.api.limits import Limits
from chatq.api.models import Models
from chatq.api.relay import Relay
from chatq.api.routes import PLAYGROUND, Service, open_router, router
from chatq.core import gc_tuning, logs, telemetry
from chatq.core.filestore import file_store
from chatq.core.queue import make_celery
from chatq.core.redis_url import async_client
from chatq.core.settings import Settings


def redis_client(settings: Settings) -> aioredis.Redis:
    # Many requests may wait on Redis at once (submits, each new stream's log read): the pool grows with them
    # rather than queueing them behind a small cap.
    return async_client(
        settings.redis_url,
        blocking=True,
        decode_responses=True,
        max_connections=10_000,
        timeout=None,
        # A command whose connection failed is sent again on a new one: after Redis restarts, every pooled one is
        # stale (after a failover, each new one asks the sentinels for the new master).
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
    )


def create_app(settings: Settings) -> FastAPI:
    client = redis_client(settings)
    store = JobStore(client, make_celery(settings), settings)
    relay = Relay(client, settings.redis_url)
    service = Service(settings, client, store, relay, Models(client, settings), Limits(client, relay))
    api_keys = Keys(settings, client)
    stored = files.Files(client, file_store(settings), settings)
    batch_files = BatchFiles(stored)
    runner = BatchRunner(service, batch_files)
    batch_service = batches.Batches(client, stored, service.models, batch_files, runner.look_now)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        api_keys.warn_if_open()
        gc_tuning.settle()
        background = [asyncio.create_task(stored.sweeping()), asyncio.create_task(runner.running())]
        if settings.fair_share:
            background.append(asyncio.create_task(dispatcher.dispatching(service)))
        yield
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await service.limits.close()
        await client.aclose()
        telemetry.shutdown()
        gc.unfreeze()

    app = FastAPI(title="chatq", lifespan=lifespan)
    app.state.service = service
    app.state.keys = api_keys
    app.state.files = stored
    app.state.batches = batch_service
    # The app's own registry, not the global one: each app counts its own requests (tests build several).
    app.state.metrics_registry = registry = CollectorRegistry()
    app.add_middleware(metrics.HTTPMetrics, requests=metrics.http_counter(registry))
    if origins := settings.cors_origin_list:
        # No cookies are read: a page's requests carry their key as a header, and Retry-After is for its eyes too.
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"], expose_headers=["*"]
        )
    app.include_router(router)
    app.include_router(responses.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(admin.router)
    if settings.allow_runtime_lora_updating:  # else not found, as vLLM leaves them out
        app.include_router(adapters.router)
    app.include_router(open_router)
    app.mount("/playground", StaticFiles(directory=PLAYGROUND), name="playground")
    # Open, as /health is and vLLM's is: scrapers rarely hold an API key, and it shows counts, never content.
    app.include_router(metrics.router)
    errors.install(app)
    return app


def traced(app: FastAPI) -> FastAPI:
    """The app with a server span per request (OTel's ASGI middleware, so it spans every route class), the parent
    of the spans of the jobs it submits. Without spans per ASGI message: a stream would have one per token."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, excluded_urls="/health,/version", exclude_spans=["receive", "send"])
    return app


def app_from_env() -> FastAPI:
    """Entry point for uvicorn (`uvicorn --factory chatq.api.app:app_from_env`): its logging and tracing set up
    here, after uvicorn set up its own."""
    settings = Settings()
    logs.configure(settings.log_format)
    app = create_app(settings)
    return traced(app) if telemetry.setup("chatq-api") else app
