"""The routes: OpenAI's chat and legacy completions, extended with background jobs, polling and resumable streams;
tokenize and detokenize; models, health and version."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute

from chatq.api.admission import ServedModel
from chatq.api.auth import CallerOf, Owner, authenticate
from chatq.api.errors import BodyTooLarge, job_error_response
from chatq.api.jobs import JobStore, Page
from chatq.api.limits import Limits, Taken, reserved_tokens
from chatq.api.models import Models
from chatq.api.relay import Relay
from chatq.api.sse import job_stream
from chatq.core import registry, telemetry, usage
from chatq.core.api_keys import ApiKey
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.errors import (
    BadRequest,
    ClientDisconnected,
    JobNotFound,
    RedisUnreachable,
    RequestTooLarge,
    ServiceUnavailable,
)
from chatq.core.fair import Share
from chatq.core.job import Event, Job, JobStatus
from chatq.core.requests import GenerationRequest
from chatq.core.settings import Settings
from chatq.core.tokenize_request import DetokenizeRequest, TokenizeRequest

MAX_SEQ = 2**63 - 1  # event numbers are the second part of Redis stream ids
CANCEL_WAIT = 5.0  # seconds a cancel waits for a running job to stop
PLAYGROUND = Path(__file__).parent / "playground"  # the playground page's files, package data


@dataclass
class Service:
    """What the routes share, built once per process by create_app."""

    settings: Settings
    redis: aioredis.Redis
    store: JobStore
    relay: Relay
    models: Models
    limits: Limits


def _service(request: Request) -> Service:
    return request.app.state.service


class JSONRequest(Request):
    """A request whose JSON body orjson reads: strict RFC 8259, so NaN, Infinity, numbers beyond a double and
    unpaired surrogates are a 400 (values nothing downstream could store or encode), and faster than Python's json.
    Its body is read only up to the limit."""

    limit = 0
    json_error: orjson.JSONDecodeError | None = None

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            chunks, size = [], 0
            async for chunk in self.stream():
                size += len(chunk)
                if size > self.limit:  # a chunked body: refused once past the limit, the rest unread
                    raise BodyTooLarge(self.limit)
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = orjson.loads(await self.body())
            except orjson.JSONDecodeError as e:
                # Raised by valid_json, after the API key's check: FastAPI reads the body before any dependency.
                self.json_error, self._json = e, None
        return self._json


async def valid_json(request: Request) -> None:
    """Raises the body's JSON error, as FastAPI would have, had it been raised while FastAPI read the body."""
    error = getattr(request, "json_error", None)
    if error is not None:
        problem = {"type": "json_invalid", "loc": ("body", error.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([problem | {"ctx": {"error": error.msg}}])


class JSONRoute(APIRoute):
    """Routes whose requests are JSONRequests. Here rather than in FastAPI's max_body_size: Starlette answers a
    Content-Length over that limit with its own plain-text 413, replacing any OpenAI-shaped one."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            limit = _service(request).settings.max_body_bytes
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                raise RequestTooLarge(limit)  # at once, none of the body read
            limited = JSONRequest(request.scope, request.receive)
            limited.limit = limit
            return await handler(limited)

        return route


Svc = Annotated[Service, Depends(_service)]
# Every route on it needs an API key when keys are configured; /health and /version stay open.
router = APIRouter(route_class=JSONRoute, dependencies=[Depends(authenticate), Depends(valid_json)])
open_router = APIRouter(route_class=JSONRoute)

# Printable ASCII, as HTTP header values are, within a length that keeps the Redis key name small.
IDEMPOTENCY_KEY = re.compile(r"[\x20-\x7e]{1,255}")


@dataclass(frozen=True)
class Submit:
    """Who submits, and the headers that shape the job: its id and idempotency key."""

    owner: str
    request_id: str | None
    idempotency_key: str | None
    key: ApiKey | None = None  # a managed key's record: the models it may use

    @property
    def in_flight(self) -> int | None:
        return self.key.limits.in_flight if self.key else None

    @property
    def weight(self) -> float:
        return self.key.limits.weight if self.key else 1.0


async def _submit_headers(
    caller: CallerOf,
    x_request_id: str | None = Header(default=None),
    idempotency_key: str | None = Header(default=None),
) -> Submit:
    if idempotency_key is not None and not IDEMPOTENCY_KEY.fullmatch(idempotency_key):
        raise BadRequest("Idempotency-Key must be 1 to 255 printable ASCII characters.", "Idempotency-Key")
    return Submit(caller.owner, x_request_id, idempotency_key, caller.key)


SubmitHeaders = Annotated[Submit, Depends(_submit_headers)]


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, svc: Svc, sub: SubmitHeaders) -> Any:
    model = await svc.models.get(body.model, need_worker=not body.background, key=sub.key)
    prompt_ids = await svc.models.off_loop(model.chat_prompt, body)
    return await _respond(svc, body, "chat", model, [prompt_ids], request, sub)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, svc: Svc, sub: SubmitHeaders) -> Any:
    model = await svc.models.get(body.model, need_worker=not body.background, key=sub.key)
    prompts = await svc.models.off_loop(model.text_prompts, body)
    return await _respond(svc, body, "text", model, prompts, request, sub)


@router.get("/v1/chat/completions")
async def list_chat_completions(
    svc: Svc,
    owner: Owner,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = None,
    order: Literal["asc", "desc"] = "asc",
    model: str | None = None,
) -> Any:
    """The caller's own jobs (chat and legacy), as OpenAI lists stored chat completions: each as GET shows it."""
    listed = await svc.store.list_jobs(owner, Page(limit, after, order == "desc", model))
    data = [await svc.store.view(job) for job in listed.jobs]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": listed.has_more}


@router.get("/v1/chat/completions/{job_id}")
async def get_chat_completion(
    job_id: str,
    svc: Svc,
    owner: Owner,
    stream: bool = False,
    starting_after: int | None = Query(default=None, ge=0, le=MAX_SEQ),
    last_event_id: str | None = Header(default=None),
) -> Any:
    job = await _completion(svc, job_id, owner)
    if not stream:
        return await svc.store.view(job)
    after = _resume_point(starting_after, last_event_id)
    last = await svc.relay.last_seq(job.id) if job.status.finished else None
    if last is not None and after >= last:
        # The client has every event, `done` included: 204 also tells a browser's EventSource to stop.
        return Response(status_code=204)
    return job_stream(svc.relay, job.id, after, svc.settings)


@router.post("/v1/chat/completions/{job_id}/cancel")
async def cancel_chat_completion(job_id: str, svc: Svc, owner: Owner) -> Any:
    await _completion(svc, job_id, owner)
    return await svc.store.view(await cancel_job(svc, job_id, owner))


async def _completion(svc: Service, job_id: str, owner: str) -> Job:
    """The chat or legacy job, if `owner` may see it; a response's id names no completion (/v1/responses serves it)."""
    job = await svc.store.get(job_id, owner)
    if job.kind == "response":
        raise JobNotFound(job_id)
    return job


async def cancel_job(svc: Service, job_id: str, owner: str) -> Job:
    """Cancels the job, if it has not ended, and reads it back: a second cancel finds it as the first left it."""
    await svc.store.cancel(job_id, owner=owner)
    job = await svc.store.get(job_id, owner)
    if job.status is JobStatus.in_progress:
        # Answered once the run stopped (at the worker's next step), so the answer shows the job cancelled;
        # a worker that does not answer in time leaves it shown running.
        with contextlib.suppress(TimeoutError):
            # From the event before the last, so that a `done` already logged is still met.
            after = max((await svc.relay.last_seq(job.id) or 0) - 1, 0)
            await asyncio.wait_for(svc.relay.done(job.id, after), CANCEL_WAIT)
        job = await svc.store.get(job_id, owner)
    return job


@router.delete("/v1/chat/completions/{job_id}")
async def delete_chat_completion(job_id: str, svc: Svc, owner: Owner) -> Any:
    await _completion(svc, job_id, owner)
    await svc.store.delete(job_id, owner)
    return {"id": job_id, "object": "chat.completion.deleted", "deleted": True}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, svc: Svc, caller: CallerOf) -> Any:
    return await svc.models.off_loop(_tokenize, await svc.models.get(body.model, key=caller.key), body)


def _tokenize(model: ServedModel, body: TokenizeRequest) -> dict[str, Any]:
    if body.messages is not None:
        ids = model.renderer.render(_as_chat(body)).ids
    elif body.prompt is not None:
        ids = model.renderer.encode(body.prompt, body.add_special_tokens is not False)
    else:
        raise BadRequest("Either `prompt` or `messages` is required.", "prompt")
    strs = [model.info.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": model.info.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, svc: Svc, caller: CallerOf) -> Any:
    return await svc.models.off_loop(_detokenize, await svc.models.get(body.model, key=caller.key), body)


def _detokenize(model: ServedModel, body: DetokenizeRequest) -> dict[str, Any]:
    vocab = model.info.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise BadRequest(f"token ids must be in 0..{vocab - 1}", "tokens")
    return {"prompt": model.info.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@open_router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def playground() -> FileResponse:
    """The playground page; it needs no key, and asks for one when the API does. Its scripts and styles are the API's
    own (PLAYGROUND, mounted at /playground): the policy lets the page load nothing from anywhere else."""
    return FileResponse(PLAYGROUND / "index.html", headers={"Content-Security-Policy": "default-src 'self'"})


@open_router.get("/version")
async def version() -> Any:
    return {"version": importlib.metadata.version("chatq")}


@router.get("/v1/usage")
async def own_usage(svc: Svc, caller: CallerOf, days: int = Query(7, ge=1, le=usage.KEPT_DAYS)) -> Any:
    """The caller's own requests, input and output tokens per day (UTC) and model, over the last `days` days; and
    its key's name and limits, if it is a managed key."""
    rows = await usage.read(svc.redis, caller.owner, days, time.time())
    return {"object": "list", "data": rows, "key": caller.key.view() if caller.key else None}


@router.get("/v1/models")
async def list_models(svc: Svc, caller: CallerOf) -> Any:
    """The models with a live worker that the caller may use, then their LoRA adapters, as vLLM lists them."""
    live = [model for model, _ in await svc.models.live()]
    adapters = [
        dataclasses.replace(m, adapter=a) for m in live for a in svc.models.adapters.values() if a.base == m.name
    ]
    shown = [m for m in live + adapters if caller.key is None or caller.key.allows(m.shown_name)]
    return {"object": "list", "data": [_card(model) for model in shown]}


@router.get("/v1/models/{model}")
async def retrieve_model(model: str, svc: Svc, caller: CallerOf) -> Any:
    return _card(await svc.models.get(model, key=caller.key))


def _card(model: ServedModel) -> dict[str, Any]:
    """A model's card; an adapter's names its files as `root` and its model as `parent`, as vLLM's does."""
    info, adapter = model.info, model.adapter
    return {
        "id": model.shown_name,
        "object": "model",
        "created": adapter.created if adapter else model.created,
        "owned_by": registry.OWNED_BY,
        "root": adapter.path if adapter else info.name,
        "parent": adapter.base if adapter else None,
        "max_model_len": info.max_model_len,
        # What a request leaves out is sampled with (docs/api.md#sampling).
        "sampling_defaults": info.sampling_defaults,
    }


@open_router.head("/health", include_in_schema=False)  # for uptime checks that send HEAD
@open_router.get("/health")
async def health(svc: Svc) -> Any:
    """Healthy while Redis answers and some model has a live worker; says which ones do."""
    try:
        await svc.redis.ping()
        live = await svc.models.live()
    except (aioredis.RedisError, RedisUnreachable):
        raise ServiceUnavailable("Redis is unreachable") from None
    if not live:
        raise ServiceUnavailable("no live worker for any model")
    return {"status": "ok", "models": {model.name: workers for model, workers in live}}


async def _respond(
    svc: Service,
    body: ChatCompletionRequest | CompletionRequest,
    kind: Literal["chat", "text"],
    model: ServedModel,
    prompts: list[list[int]],
    request: Request,
    sub: Submit,
) -> Any:
    """Submits the job, then answers as the request asks: its stream, 202 with the job, or the whole answer.

    A repeated idempotency key answers the same way with the job it names. Only the request that created a job
    cancels it when its client disconnects: a retry that goes away leaves the job to the others waiting on it.
    """
    request_id = sub.request_id or body.request_id
    trace = telemetry.job_trace(request.headers)

    def submit(share: Share) -> Awaitable[tuple[Job, int | None, bool]]:
        return svc.store.submit(
            body,
            kind,
            model.name,
            prompts,
            request_id,
            sub.owner,
            sub.idempotency_key,
            trace,
            in_flight=sub.in_flight,
            share=share,
            adapter=model.adapter,
        )

    job, position, created, taken = await submit_within_limits(svc, sub, body, model, prompts, submit)
    answer = await _answer(svc, body, job, position, request, created and not body.background)
    answer.headers["x-request-id"] = job.id  # the openai SDK's `_request_id`: the id to look the job up by
    answer.headers.update(taken.headers() if taken else {})
    return answer


async def submit_within_limits(
    svc: Service,
    sub: Submit,
    body: GenerationRequest,
    model: ServedModel,
    prompts: list[list[int]],
    submit: Callable[[Share], Awaitable[tuple[Job, int | None, bool]]],
) -> tuple[Job, int | None, bool, Taken | None]:
    """`submit(share)`'s job, its queue position and whether it was created, once the request was taken from its
    key's limits (raises RateLimited); what it took, for the answer's x-ratelimit-* headers. `share`: what the job
    counts for in its key's fair share."""
    reserved = reserved_tokens(body, prompts, model.info)
    taken = await svc.limits.take(sub.key, sub.owner, model.name, reserved)
    everything = taken.verdict.tokens if taken else 0
    try:
        job, position, created = await submit(Share.of(prompts, reserved, sub.weight))
    except Exception:
        await svc.limits.give_back(sub.owner, taken, True, everything)
        raise
    if created:
        svc.limits.give_back_unused(sub.owner, taken, job.id)
    else:  # an idempotent repeat: the first request took what this job uses
        await svc.limits.give_back(sub.owner, taken, True, everything)
    return job, position, created, taken


async def _answer(
    svc: Service,
    body: ChatCompletionRequest | CompletionRequest,
    job: Job,
    position: int | None,
    request: Request,
    cancels: bool,
) -> Response:
    if body.stream:
        on_disconnect = (lambda: svc.store.cancel_soon(job.id)) if cancels else None
        return job_stream(svc.relay, job.id, 0, svc.settings, on_disconnect)
    if body.background:
        return JSONResponse(await svc.store.view(job, position), status_code=202)
    done = await done_or_disconnected(svc, job.id, request, cancels)
    if done.data is not None:  # completed: the answer came with `done`
        return Response(orjson.dumps(done.data), media_type="application/json")
    return await _finished(svc, await svc.store.get(job.id))


async def done_or_disconnected(svc: Service, job_id: str, request: Request, cancels: bool) -> Event:
    """The job's `done` event once it ended; if the client disconnects first, the job is cancelled (if `cancels`)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done_task, gone_task = asyncio.create_task(svc.relay.done(job_id)), asyncio.create_task(disconnected())
    finished, _ = await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    for t in (done_task, gone_task):
        t.cancel()
    if done_task not in finished:
        if cancels:
            svc.store.cancel_soon(job_id)
        raise ClientDisconnected("The client disconnected.")
    return done_task.result()


async def _finished(svc: Service, job: Job) -> JSONResponse:
    if job.status is JobStatus.failed and job.error:
        return job_error_response(job.error)
    return JSONResponse(await svc.store.view(job) if job.status is not JobStatus.completed else job.result)


def _resume_point(starting_after: int | None, last_event_id: str | None) -> int:
    """Where a resumed stream starts. A browser's EventSource reconnects to the same URL, starting_after and all, and
    names in Last-Event-ID the last event it got: the later of the two is where the client stands."""
    after = starting_after or 0
    if last_event_id:
        seen = int(last_event_id) if last_event_id.isascii() and last_event_id.isdigit() else -1
        if not 0 <= seen <= MAX_SEQ:
            raise BadRequest("Last-Event-ID must be an event sequence number.", "Last-Event-ID")
        after = max(after, seen)
    return after


def _as_chat(body: TokenizeRequest) -> ChatCompletionRequest:
    """The chat request whose prompt /tokenize counts."""
    chat = ChatCompletionRequest(
        messages=body.messages or [],
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs,
        add_special_tokens=bool(body.add_special_tokens),
        tools=body.tools,
        documents=body.documents,
        chat_template=body.chat_template,
    )
    chat.check()
    return chat
