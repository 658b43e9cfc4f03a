"""The HTTP API: OpenAI's chat-completions resource, extended with background jobs, polling and resumable streams."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from functools import cached_property
from typing import Any, Literal

import orjson
import redis.asyncio as aioredis
from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError

from chatq.api import errors
from chatq.api.errors import BadRequest, ClientDisconnected, ModelNotFound, ServiceUnavailable
from chatq.api.jobs import JobStore
from chatq.api.relay import Relay, ending
from chatq.core import collector, keys
from chatq.core.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Event,
    EventKind,
    GenerationRequest,
    Job,
    JobStatus,
    TokenizeRequest,
)
from chatq.core.queue import make_celery
from chatq.core.render import Renderer
from chatq.core.settings import Settings

log = logging.getLogger(__name__)

MAX_SEQ = 2**63 - 1  # event numbers are the second part of Redis stream ids
CANCEL_WAIT = 5.0  # seconds a cancel waits for a running job to stop


class EventStream(EventSourceResponse):
    """sse-starlette's response with its send timeout on keep-alives only.

    sse-starlette times each frame's send out in an anyio cancel scope, about 6 us a frame: a tenth of the API's CPU
    per relayed frame. A client that stops reading without disconnecting stalls every send once the socket's buffers
    are full, the keep-alives' too, so timing the keep-alive out alone ends such a stream (and with it the job of a
    stream that cancels on disconnect), at no cost per frame.
    """

    async def _send_with_timeout(self, send: Any, message: Any) -> None:
        if message.get("body") == KeepAlive.FRAME:
            await super()._send_with_timeout(send, message)
        else:
            await send(message)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_end_with_timeout(message: Any) -> None:
            # sse-starlette sends a stream's end without its timeout, holding the lock the keep-alives take: a client
            # stuck as its stream ends would hold both for ever.
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await EventSourceResponse._send_with_timeout(self, send, message)
            else:
                await send(message)

        try:
            await super().__call__(scope, receive, send_end_with_timeout)
        except SendTimeoutError:
            log.warning("a client read nothing of its stream for %s s; it is dropped", self.send_timeout)


class JSONRequest(Request):
    """A request whose JSON body orjson reads: strict RFC 8259, so NaN, Infinity, numbers beyond a double and
    unpaired surrogates are a 400 (Python's json takes them, and they would reach the job record and the tokenizer
    as values nothing downstream can store or encode), and 3-4x faster than Python's json on a chat body."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class JSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(JSONRequest(request.scope, request.receive))

        return route


class KeepAlive(ServerSentEvent):
    """The keep-alive of a quiet stream: one comment line and no blank line after it. A blank line ends an event, and
    once a stream has carried an `id:` (every chatq stream does, for resuming) the openai SDK turns an event with no
    data into a crash in json.loads."""

    FRAME = b": keep-alive\n"

    def encode(self) -> bytes:
        return self.FRAME


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
    def config(self) -> dict[str, Any]:
        return json.loads((self.dir / "config.json").read_text())

    @cached_property
    def max_model_len(self) -> int:
        return self.settings.max_model_len or int(self.config.get("max_position_embeddings", 2048))

    @cached_property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or self.renderer.tokenizer.get_vocab_size())


def create_app(settings: Settings) -> FastAPI:
    # Hundreds of requests may wait on Redis at once (submits, each new stream's log read): the pool grows with
    # them instead of making them queue behind a small cap.
    # A command whose connection failed is sent again on a new one: after Redis restarts, every pooled connection is
    # stale and fails its next command (before Redis saw it), which would otherwise reach a client as an error.
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        decode_responses=True,
        max_connections=10_000,
        timeout=None,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
    )
    client = aioredis.Redis(connection_pool=pool)
    store = JobStore(client, make_celery(settings), settings)
    relay = Relay(client, settings.redis_url)
    model = Model(settings)
    background: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        collector.settle()
        yield
        await client.aclose()
        gc.unfreeze()

    app = FastAPI(title="chatq", lifespan=lifespan)
    app.router.route_class = JSONRoute
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

    def sse(job_id: str, after: int, cancel_on_disconnect: bool) -> EventStream:
        async def frames() -> AsyncIterator[bytes]:
            finished, last = False, after
            try:
                # Events that arrived together leave in one write: a stream that fell behind catches up cheaply.
                async for batch in relay.batches(job_id, after):
                    yield b"".join(e.sse_frame() for e in batch)
                    last = batch[-1].seq
                finished = True
            except Exception:
                # The client is still there: it gets an error and the end of the stream, and its job goes on.
                log.exception("relaying job %s failed", job_id)
                finished = True
                failed = ending(last, "Relaying this job's output failed; resume the stream to read the rest.")
                yield b"".join(e.sse_frame() for e in failed)
            finally:
                if cancel_on_disconnect and not finished:
                    cancel_later(job_id)

        return EventStream(
            frames(),
            ping=settings.sse_keepalive,
            ping_message_factory=KeepAlive,
            send_timeout=settings.sse_send_timeout,
            headers={"X-Accel-Buffering": "no"},
        )

    async def ended(job_id: str, after: int = 0) -> Event:
        """The job's `done` event, once it ended."""
        # Closed here, not by the garbage collector: closing leaves the job's channel.
        async with contextlib.aclosing(relay.events(job_id, after)) as events:
            async for event in events:
                if event.event is EventKind.done:
                    return event
        raise RuntimeError("a job's events ended without `done`")

    async def wait_done(job_id: str, request: Request) -> Event | None:
        """The job's `done` event once it ended; None, with the job cancelled, if the client disconnected first."""

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        done_task, gone_task = asyncio.create_task(ended(job_id)), asyncio.create_task(disconnected())
        finished, _ = await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        for t in (done_task, gone_task):
            t.cancel()
        if done_task not in finished:
            cancel_later(job_id)
            return None
        return done_task.result()

    def admit(body: GenerationRequest, prompt_ids: list[int]) -> list[int]:
        """Checks that need the tokenizer or the context length; returns the prompt as it will run."""
        limit = model.max_model_len
        if body.truncate_prompt_tokens is not None:
            keep = limit if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
            if keep > limit:
                raise BadRequest(
                    f"truncate_prompt_tokens ({keep}) cannot be greater than the model's context length ({limit}).",
                    "truncate_prompt_tokens",
                )
            prompt_ids = prompt_ids[-keep:]
        if len(prompt_ids) >= limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(prompt_ids)} input tokens, leaving no room for the completion. Please reduce the length of "
                "the messages or the prompt.",
                "input_tokens",
            )
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        if (body.max_new_tokens or 0) > limit:
            raise BadRequest(
                f"{param} ({body.max_new_tokens}) must be at most the model's context length ({limit}).", param
            )
        room = limit - len(prompt_ids)
        if body.min_tokens > room:
            raise BadRequest(
                f"min_tokens ({body.min_tokens}) is more than the {room} tokens left after the prompt.", "min_tokens"
            )
        vocab = model.vocab_size
        body.check_bias(vocab)
        if any(t >= vocab for t in body.stop_token_ids or []):
            raise BadRequest(f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise BadRequest(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        return prompt_ids

    async def respond(
        body: ChatCompletionRequest | CompletionRequest,
        kind: Literal["chat", "text"],
        prompt_ids: list[int],
        request: Request,
        x_request_id: str | None,
    ) -> Any:
        job, position = await store.submit(
            body, kind, resolve_model(body.model), prompt_ids, x_request_id or body.request_id
        )
        if body.stream:
            return sse(job.id, 0, cancel_on_disconnect=not body.background)
        if body.background:
            return JSONResponse(await store.view(job, position), status_code=202)
        done = await wait_done(job.id, request)
        if done is None:
            raise ClientDisconnected("The client disconnected.")
        if done.data is not None:  # completed: the answer came with `done`
            return Response(orjson.dumps(done.data), media_type="application/json")
        return await finished_response(await store.get(job.id))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        body: ChatCompletionRequest, request: Request, x_request_id: str | None = Header(default=None)
    ) -> Any:
        body.check()
        resolve_model(body.model)
        prompt_ids = admit(body, model.renderer.render(body).ids)
        return await respond(body, "chat", prompt_ids, request, x_request_id)

    @app.post("/v1/completions")
    async def create_completion(
        body: CompletionRequest, request: Request, x_request_id: str | None = Header(default=None)
    ) -> Any:
        body.check()
        resolve_model(body.model)
        prompt_ids = admit(body, model.renderer.encode(body.prompt, body.add_special_tokens))
        return await respond(body, "text", prompt_ids, request, x_request_id)

    async def finished_response(job: Job) -> JSONResponse:
        if job.status is JobStatus.failed and job.error:
            return JSONResponse({"error": job.error}, status_code=int(job.error.get("code") or 500))
        return JSONResponse(await store.view(job) if job.status is not JobStatus.completed else job.result)

    @app.get("/v1/chat/completions/{job_id}")
    async def get_chat_completion(
        job_id: str,
        stream: bool = False,
        starting_after: int | None = Query(default=None, ge=0, le=MAX_SEQ),
        last_event_id: str | None = Header(default=None),
    ) -> Any:
        job = await store.get(job_id)
        if not stream:
            return await store.view(job)
        after = starting_after or 0
        if last_event_id:
            seen = int(last_event_id) if last_event_id.isascii() and last_event_id.isdigit() else -1
            if not 0 <= seen <= MAX_SEQ:
                raise BadRequest("Last-Event-ID must be an event sequence number.", "Last-Event-ID")
            # A browser's EventSource reconnects to the same URL, starting_after and all, and names in this header
            # the last event it got: the later of the two is where the client stands.
            after = max(after, seen)
        last = await relay.last_seq(job.id) if job.status.finished else None
        if last is not None and after >= last:
            # The client has every event, `done` included: 204 also tells a browser's EventSource to stop.
            return Response(status_code=204)
        return sse(job.id, after, cancel_on_disconnect=False)

    @app.post("/v1/chat/completions/{job_id}/cancel")
    async def cancel_chat_completion(job_id: str) -> Any:
        await store.cancel(job_id)
        job = await store.get(job_id)
        if job.status is JobStatus.in_progress:
            # Answered once the run stopped (at the worker's next step), so the answer shows the job cancelled;
            # a worker that does not answer in time leaves it shown running.
            with contextlib.suppress(TimeoutError):
                # From the event before the last, so that a `done` already logged is still met.
                after = max((await relay.last_seq(job.id) or 0) - 1, 0)
                await asyncio.wait_for(ended(job.id, after), CANCEL_WAIT)
            job = await store.get(job_id)
        return await store.view(job)

    @app.delete("/v1/chat/completions/{job_id}")
    async def delete_chat_completion(job_id: str) -> Any:
        await store.delete(job_id)
        return {"id": job_id, "object": "chat.completion.deleted", "deleted": True}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        resolve_model(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs,
                add_special_tokens=bool(body.add_special_tokens),
                tools=body.tools,
                documents=body.documents,
            )
            chat.check()
            ids = model.renderer.render(chat).ids
        elif body.prompt is not None:
            ids = model.renderer.encode(body.prompt, body.add_special_tokens is not False)
        else:
            raise BadRequest("Either `prompt` or `messages` is required.", "prompt")
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": model.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if body.return_token_strs:
            out["token_strs"] = [model.renderer.tokenizer.id_to_token(i) for i in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        resolve_model(body.model)
        if any(not 0 <= t < model.vocab_size for t in body.tokens):
            raise BadRequest(f"token ids must be in 0..{model.vocab_size - 1}", "tokens")
        return {"prompt": model.renderer.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version() -> Any:
        return {"version": importlib.metadata.version("chatq")}

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
    """Entry point for uvicorn (`uvicorn --factory chatq.api.app:app_from_env`)."""
    return create_app(Settings())
