"""The HTTP API: OpenAI's chat-completions resource, extended with background jobs, polling and resumable streams."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cached_property
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from api import errors
from api.errors import BadRequest, ModelNotFound, ServiceUnavailable
from api.jobs import JobStore
from api.relay import Relay
from shared import keys
from shared.protocol import ChatCompletionRequest, EventKind, Job, JobStatus, error_body
from shared.queue import make_celery
from shared.settings import Settings
from worker.render import Renderer


class Model:
    """What the API knows of the served model: its name, context length and chat template (no weights)."""

    def __init__(self, settings: Settings):
        self.name = settings.model_name
        self.dir = settings.model_dir
        self.settings = settings
        self.created = int(time.time())

    @cached_property
    def renderer(self) -> Renderer:
        if not (self.dir / "tokenizer.json").exists():
            raise ServiceUnavailable(f"The files of model `{self.name}` are not available yet.")
        return Renderer(self.dir)

    @cached_property
    def max_model_len(self) -> int:
        if self.settings.max_model_len:
            return self.settings.max_model_len
        config = json.loads((self.dir / "config.json").read_text())
        return int(config.get("max_position_embeddings", 2048))


def create_app(settings: Settings) -> FastAPI:
    client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    store = JobStore(client, make_celery(settings), settings)
    relay = Relay(client)
    model = Model(settings)
    background: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="chatq", lifespan=lifespan)
    errors.install(app)

    def resolve_model(name: str | None) -> str:
        if name and name != model.name:
            raise ModelNotFound(name)
        return model.name

    def cancel_later(job_id: str) -> None:
        # Runs after the client went away: the request's own task is being cancelled, so detach the cancel.
        task = asyncio.create_task(store.cancel(job_id))
        background.add(task)
        task.add_done_callback(background.discard)

    def sse(job_id: str, after: int, cancel_on_disconnect: bool) -> EventSourceResponse:
        async def frames() -> AsyncIterator[dict[str, Any]]:
            finished = False
            try:
                async for event in relay.events(job_id, after):
                    yield {"id": str(event.seq), "data": event.sse_data()}
                finished = True
            finally:
                if cancel_on_disconnect and not finished:
                    cancel_later(job_id)

        return EventSourceResponse(frames(), ping=15, headers={"X-Accel-Buffering": "no"})

    async def wait_done(job_id: str, request: Request) -> bool:
        """True once the job ended; False, with the job cancelled, if the client disconnected first."""

        async def ended() -> None:
            async for event in relay.events(job_id):
                if event.event is EventKind.done:
                    return

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        done_task, gone_task = asyncio.create_task(ended()), asyncio.create_task(disconnected())
        finished, _ = await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        for t in (done_task, gone_task):
            t.cancel()
        if done_task not in finished:
            cancel_later(job_id)
            return False
        return True

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        body.check()
        name = resolve_model(body.model)
        prompt = model.renderer.render(body)
        if len(prompt.ids) >= model.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {model.max_model_len} tokens. However, your prompt "
                f"contains {len(prompt.ids)} input tokens, leaving no room for the completion. Please shorten "
                "your messages.",
                "input_tokens",
            )
        if (body.max_new_tokens or 0) > model.max_model_len:
            param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            raise BadRequest(f"{param} must be at most the model's context length ({model.max_model_len})", param)
        job = await store.submit(body, name, prompt.ids)
        if body.stream:
            return sse(job.id, 0, cancel_on_disconnect=not body.background)
        if body.background:
            return JSONResponse(await store.view(job), status_code=202)
        if not await wait_done(job.id, request):
            return JSONResponse(error_body("The client disconnected.", "APIError", 499), status_code=499)
        return await finished_response(await store.get(job.id))

    async def finished_response(job: Job) -> JSONResponse:
        if job.status is JobStatus.failed and job.error:
            return JSONResponse({"error": job.error}, status_code=int(job.error.get("code") or 500))
        return JSONResponse(await store.view(job) if job.status is not JobStatus.completed else job.result)

    @app.get("/v1/chat/completions/{job_id}")
    async def get_chat_completion(
        job_id: str,
        stream: bool = False,
        starting_after: int | None = Query(default=None, ge=0),
        last_event_id: str | None = Header(default=None),
    ) -> Any:
        job = await store.get(job_id)
        if not stream:
            return await store.view(job)
        after = starting_after
        if after is None and last_event_id:
            try:
                after = int(last_event_id)
            except ValueError as e:
                raise BadRequest("Last-Event-ID must be an event sequence number", "Last-Event-ID") from e
        return sse(job.id, after or 0, cancel_on_disconnect=False)

    @app.post("/v1/chat/completions/{job_id}/cancel")
    async def cancel_chat_completion(job_id: str) -> Any:
        await store.cancel(job_id)
        return await store.view(await store.get(job_id))

    @app.delete("/v1/chat/completions/{job_id}")
    async def delete_chat_completion(job_id: str) -> Any:
        await store.delete(job_id)
        return {"id": job_id, "object": "chat.completion.deleted", "deleted": True}

    @app.get("/v1/models")
    async def list_models() -> Any:
        return {
            "object": "list",
            "data": [
                {
                    "id": model.name,
                    "object": "model",
                    "created": model.created,
                    "owned_by": "chatq",
                    "max_model_len": model.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> Any:
        missing = []
        try:
            await client.ping()
            live = await client.zcount(keys.workers(model.name), time.time() - settings.worker_ttl, "+inf")
            if not live:
                missing.append(f"no live worker for model `{model.name}`")
        except aioredis.RedisError:
            missing.append("Redis is unreachable")
        if missing:
            raise ServiceUnavailable("; ".join(missing))
        return {"status": "ok", "model": model.name, "workers": live}

    return app


def app_from_env() -> FastAPI:
    """Entry point for uvicorn (`uvicorn --factory api.app:app_from_env`)."""
    return create_app(Settings())
