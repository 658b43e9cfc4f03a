"""OpenAI's Responses API: /v1/responses, each response a chat job of kind `response`. Its request, Response object
and stream events are chatq.core's responses_request, response_object and response_events."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from chatq.api.admission import ServedModel
from chatq.api.auth import Owner, authenticate
from chatq.api.routes import (
    MAX_SEQ,
    JSONRoute,
    Service,
    SubmitHeaders,
    Svc,
    cancel_job,
    done_or_disconnected,
    submit_within_limits,
    valid_json,
)
from chatq.api.sse import EventStream, event_stream
from chatq.core import telemetry
from chatq.core.api_keys import ApiKey
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.errors import BadRequest, JobGone, JobNotFound, NotFound, RelayFailed, ResponseNotFound
from chatq.core.fair import Share
from chatq.core.job import Job, JobStatus
from chatq.core.response_events import ResponseEvents
from chatq.core.response_object import output_items, response_error, response_object
from chatq.core.responses_request import ResponsesRequest, chat_request, input_items

router = APIRouter(route_class=JSONRoute, dependencies=[Depends(authenticate), Depends(valid_json)])


async def _get(svc: Service, response_id: str, owner: str | None, param: str = "response_id") -> Job:
    """The response job, if `owner` may see it; a chat job's id names no response."""
    try:
        job = await svc.store.get(response_id, owner)
    except JobNotFound:
        raise ResponseNotFound(response_id, param) from None
    if job.kind != "response":
        raise ResponseNotFound(response_id, param)
    return job


async def _history(svc: Service, body: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
    """The items the earlier response's conversation held, and its output: where this one's starts."""
    if body.previous_response_id is None:
        return []
    prev = await _get(svc, body.previous_response_id, owner, "previous_response_id")
    if not prev.status.finished:
        raise BadRequest(
            f"Previous response '{prev.id}' has not finished; it is {prev.status.value}.", "previous_response_id"
        )
    stored = prev.response or {}
    output = output_items(prev.id, prev.result)
    return [*stored.get("context", []), *stored.get("input", []), *output]


@dataclass(frozen=True)
class Prepared:
    """A response's chat job, ready to submit: its model, chat request and prompt, and the response's own fields."""

    model: ServedModel
    chat: ChatCompletionRequest
    prompt_ids: list[int]
    stored: dict[str, Any]


async def prepare(
    svc: Service, body: ResponsesRequest, owner: str, response_id: str, key: ApiKey | None = None
) -> Prepared:
    """The chat job that answers `body` as response `response_id`."""
    if body.background and not body.store:
        raise BadRequest("A background response must be stored: background needs store true.", "store")
    model = await svc.models.get(body.model, need_worker=not body.background, key=key)
    context = await _history(svc, body, owner)
    items = input_items(body, response_id)
    chat, names = chat_request(body, context, items)
    with names.renaming_errors():
        prompt_ids = await svc.models.off_loop(model.chat_prompt, chat)
    return Prepared(model, chat, prompt_ids, {"request": body.echo(), "input": items, "context": context})


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, svc: Svc, sub: SubmitHeaders) -> Any:
    # The id is chosen here, so the input items' ids can carry it.
    request_id = sub.request_id or uuid.uuid4().hex
    ready = await prepare(svc, body, sub.owner, "resp_" + request_id, sub.key)
    trace = telemetry.job_trace(request.headers)

    def submit(share: Share) -> Awaitable[tuple[Job, int | None, bool]]:
        return svc.store.submit(
            ready.chat,
            "response",
            ready.model.name,
            [ready.prompt_ids],
            request_id,
            sub.owner,
            sub.idempotency_key,
            trace,
            response=ready.stored,
            in_flight=sub.in_flight,
            adapter=ready.model.adapter,
            share=share,
        )

    job, _, created, taken = await submit_within_limits(svc, sub, ready.chat, ready.model, [ready.prompt_ids], submit)
    answer = await _answer(svc, body, job, request, created and not body.background)
    answer.headers["x-request-id"] = job.id  # the openai SDK's `_request_id`
    answer.headers.update(taken.headers() if taken else {})
    return answer


def answered(job: Job) -> tuple[int, dict[str, Any]]:
    """An ended response job's HTTP status and body: the request's fault is answered as chat's is."""
    if job.status is JobStatus.failed and job.error and job.error.get("type") == "BadRequestError":
        return int(job.error.get("code") or 400), {"error": job.error}
    return 200, response_object(job)


async def _answer(svc: Service, body: ResponsesRequest, job: Job, request: Request, cancels: bool) -> Response:
    if body.stream:
        on_disconnect = (lambda: svc.store.cancel_soon(job.id)) if cancels else None
        return _stream(svc, job, -1, on_disconnect)
    if body.background:
        return JSONResponse(response_object(job))
    await done_or_disconnected(svc, job.id, request, cancels)
    status, payload = answered(await svc.store.get(job.id))
    return JSONResponse(payload, status_code=status)


@router.get("/v1/responses/{response_id}")
async def get_response(
    response_id: str,
    svc: Svc,
    owner: Owner,
    stream: bool = False,
    starting_after: int | None = Query(default=None, ge=0, le=MAX_SEQ),
) -> Any:
    job = await _get(svc, response_id, owner)
    if not stream:
        return response_object(job)
    return _stream(svc, job, -1 if starting_after is None else starting_after)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, svc: Svc, owner: Owner) -> Any:
    await _get(svc, response_id, owner)
    return response_object(await cancel_job(svc, response_id, owner))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, svc: Svc, owner: Owner) -> Any:
    await _get(svc, response_id, owner)
    await svc.store.delete(response_id, owner)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    svc: Svc,
    owner: Owner,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> Any:
    """The response's own input items (not the earlier responses'), newest first unless `order` is asc."""
    job = await _get(svc, response_id, owner)
    items = list((job.response or {}).get("input", []))
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise NotFound(f"No input item found with id '{after}'.", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": len(items) > limit}


def _stream(svc: Service, job: Job, after: int, on_disconnect: Callable[[], None] | None = None) -> EventStream:
    """The response's typed events numbered above `after`, replayed from its job's log then followed live."""
    # Every stream translates the log from its start: the events' numbers are the same in all of them.
    events = ResponseEvents(job.id)

    def failure() -> bytes:
        error = response_error(RelayFailed().body()["error"])
        return _sse([{"type": "error", "sequence_number": events.seq + 1, **error}], after)

    frames = _frames(svc, job, events, after)
    return event_stream(frames, svc.settings, failure, on_disconnect, f"response {job.id}")


def _sse(events: list[dict[str, Any]], after: int) -> bytes:
    """The events past `after` as SSE frames, named by type as OpenAI sends them."""
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (e["type"].encode(), orjson.dumps(e))
        for e in events
        if e["sequence_number"] > after
    )


async def _frames(svc: Service, job: Job, events: ResponseEvents, after: int) -> AsyncGenerator[bytes, None]:
    # As OpenAI opens them: a background response is queued, one streamed as it runs is in progress at once.
    background = ((job.response or {}).get("request") or {}).get("background")
    status = JobStatus.queued if background else JobStatus.in_progress
    opening = job.model_copy(update={"status": status, "result": None, "error": None})
    snapshot = response_object(opening)
    if frame := _sse(events.opening(snapshot), after):
        yield frame
    snapshot["status"] = "in_progress"
    async for batch in svc.relay.batches(job.id, 0):
        out = [e for event in batch for e in events.feed(event, snapshot)]
        if events.ended:
            out += events.terminal(await _final(svc, job, snapshot))
        if frame := _sse(out, after):
            yield frame


async def _final(svc: Service, job: Job, snapshot: dict[str, Any]) -> dict[str, Any]:
    """The Response as its job ended; failed, if its record is gone (deleted or expired while streamed)."""
    try:
        return response_object(await svc.store.get(job.id))
    except JobNotFound:
        return {**snapshot, "status": "failed", "error": response_error(JobGone().body()["error"])}
