"""The one place that turns errors into OpenAI-shaped HTTP responses."""

from __future__ import annotations

from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from chatq.core.errors import BadRequest, ChatqError, InternalError, RedisUnreachable, RequestTooLarge


def error_response(e: ChatqError) -> JSONResponse:
    """The HTTP answer to `e`: its status, its OpenAI error body and its headers (Retry-After, WWW-Authenticate)."""
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def job_error_response(error: dict[str, Any]) -> JSONResponse:
    """A failed job's stored error (OpenAI's error object) as its request's HTTP answer."""
    return JSONResponse({"error": error}, status_code=int(error.get("code") or 500))


class _HTTPError(ChatqError):
    """What Starlette itself refuses (an unknown route, a method the route does not take), in OpenAI's shape."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}

    def __init__(self, e: HTTPException):
        super().__init__(str(e.detail), headers=dict(e.headers or {}))  # a 405's Allow
        self.status, self.type = e.status_code, self.TYPES.get(e.status_code, "APIError")


class BodyTooLarge(HTTPException):
    """A body that passed the limit while it was read: an HTTPException, as FastAPI turns any other exception raised
    while it reads a body into a 400; answered as RequestTooLarge."""

    def __init__(self, limit: int):
        super().__init__(413)
        self.limit = limit


def _param(loc: tuple) -> str | None:
    """The request field an error's location names. pydantic adds a step for each branch of a union it tried
    (`str`, `list[...]`, `literal[...]`, a model's class name), which names no field: those are left out."""
    parts = [
        str(p)
        for p in loc
        if p not in _LOCATIONS
        and (isinstance(p, int) or (p.isidentifier() and p[:1].islower() and p not in _TYPE_STEPS))
    ]
    return ".".join(parts) or None


_TYPE_STEPS = {"str", "int", "float", "bool", "list", "dict", "none"}
_LOCATIONS = {"body", "query", "header", "path"}  # where FastAPI found the value, not a field's name


def _first_error(errors: list[dict]) -> dict:
    """The error to report: the first one's field, at the deepest place any union branch got to in it (a
    `tool_choice` object missing its `function` says so, rather than that it is not one of the strings)."""
    first = errors[0]
    top = _param(tuple(first.get("loc", ())))
    if top is None:
        return first
    places = [(e, _param(tuple(e.get("loc", ()))) or "") for e in errors]
    same = [(e, p) for e, p in places if p == top or p.startswith(top + ".")]
    return max(same, key=lambda ep: ep[1].count("."))[0]


def _validation_error(e: RequestValidationError) -> BadRequest:
    """OpenAI answers a bad body with 400, not FastAPI's 422; the first problem names the param."""
    first = _first_error(list(e.errors()))
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error")
        return BadRequest(f"The request body is not valid JSON: {why}.")
    param = _param(tuple(first.get("loc", ())))
    msg = first.get("msg", "Invalid request").removeprefix("Value error, ")  # a validator's own message, as it wrote it
    if first.get("type") == "missing":
        msg = f"Missing required parameter: '{param}'." if param else "The request body is missing."
    elif not param and first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        msg = "The request body must be a JSON object (with content-type application/json)."
    return BadRequest(f"{msg} ({param})" if param and "'" not in msg else msg, param)


def install(app: FastAPI) -> None:
    @app.exception_handler(ChatqError)
    async def _chatq_error(_: Request, e: ChatqError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(e))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        if isinstance(e, BodyTooLarge):
            return error_response(RequestTooLarge(e.limit))
        return error_response(_HTTPError(e))

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _redis_unreachable(_: Request, e: Exception) -> JSONResponse:
        # Redis restarting or out of reach: a 503, which clients such as the openai SDK retry, not a 500.
        return error_response(RedisUnreachable())

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return error_response(InternalError("The server had an error processing the request."))
