"""The errors a client can see, one type each, and the one place that turns them into OpenAI-shaped responses."""

from __future__ import annotations

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from chatq.core.protocol import RequestError, error_body


class APIError(Exception):
    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers


class BadRequest(APIError):
    status, type = 400, "BadRequestError"


class Conflict(APIError):
    status, type = 409, "ConflictError"


class ModelNotFound(APIError):
    status, type = 404, "NotFoundError"

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.", "model")


class JobNotFound(APIError):
    status, type = 404, "NotFoundError"

    def __init__(self, job_id: str):
        super().__init__(f"No chat completion found with id '{job_id}'.", "completion_id")


class ClientDisconnected(APIError):
    """Nginx's 499: nobody reads it, but the access log and the metrics tell it from a served request."""

    status, type = 499, "APIError"


class ServiceUnavailable(APIError):
    status, type = 503, "ServiceUnavailableError"


def _response(status: int, type_: str, message: str, param: str | None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param), status_code=status, headers=headers)


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


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _response(e.status, e.type, e.message, e.param, e.headers)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return _response(400, "BadRequestError", e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI answers a bad body with 400, not FastAPI's 422; the first problem names the param.
        first = _first_error(list(e.errors()))
        if first.get("type") == "json_invalid":
            why = (first.get("ctx") or {}).get("error")
            return _response(400, "BadRequestError", f"The request body is not valid JSON: {why}.", None)
        param = _param(tuple(first.get("loc", ())))
        msg = first.get("msg", "Invalid request")
        if first.get("type") == "missing":
            msg = f"Missing required parameter: '{param}'." if param else "The request body is missing."
        return _response(400, "BadRequestError", f"{msg} ({param})" if param and "'" not in msg else msg, param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        type_ = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}.get(
            e.status_code, "APIError"
        )
        return _response(e.status_code, type_, str(e.detail), None)

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _redis_unreachable(_: Request, e: Exception) -> JSONResponse:
        # Redis restarting or out of reach: a 503, which clients such as the openai SDK retry, not a 500.
        headers = {"Retry-After": "1"}
        return _response(503, "ServiceUnavailableError", "The job store (Redis) is unreachable; retry.", None, headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return _response(500, "InternalServerError", "The server had an error processing the request.", None)
