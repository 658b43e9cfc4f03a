"""The errors a client can see, one type each, with OpenAI's error body.

The API answers them as HTTP errors (chatq.api.errors maps them, in one place); a stream that fails after its 200
carries the same body in-band, built by the same constructors.
"""

from __future__ import annotations

from typing import Any


class ChatqError(Exception):
    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """OpenAI's error object, as an HTTP answer and a stream's error event carry it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class InternalError(ChatqError):
    """Something failed on chatq's side: a job that could not run, a stream that could not be relayed."""


class BadRequest(ChatqError):
    """A request field is invalid; `param` names it."""

    status, type = 400, "BadRequestError"


class NotFound(ChatqError):
    status, type = 404, "NotFoundError"


class ModelNotFound(NotFound):
    def __init__(self, model: str):
        shown = model if len(model) <= 200 else model[:200] + "..."  # a body's worth of name is not repeated
        super().__init__(f"The model `{shown}` does not exist.", "model")


class JobNotFound(NotFound):
    def __init__(self, job_id: str, param: str = "completion_id"):
        super().__init__(f"No chat completion found with id '{job_id}'.", param)


class ResponseNotFound(NotFound):
    def __init__(self, response_id: str, param: str = "response_id"):
        super().__init__(f"No response found with id '{response_id}'.", param)


class FileNotFound(NotFound):
    def __init__(self, file_id: str, param: str = "file_id"):
        shown = file_id if len(file_id) <= 200 else file_id[:200] + "..."
        super().__init__(f"No such File object: {shown}", param)


class BatchNotFound(NotFound):
    def __init__(self, batch_id: str, param: str = "batch_id"):
        shown = batch_id if len(batch_id) <= 200 else batch_id[:200] + "..."
        super().__init__(f"No such Batch object: {shown}", param)


class ApiKeyNotFound(NotFound):
    def __init__(self, name: str):
        shown = name if len(name) <= 200 else name[:200] + "..."
        super().__init__(f"No API key named '{shown}'.", "name")


class JobGone(NotFound):
    """A stream whose job was deleted or expired while it was open or before it resumed."""

    def __init__(self) -> None:
        super().__init__("The job was deleted or has expired.")


class AuthenticationFailed(ChatqError):
    """A missing or wrong API key; the message never repeats the key sent."""

    status, type = 401, "AuthenticationError"

    def __init__(self) -> None:
        super().__init__(
            "Incorrect or missing API key; send it as `Authorization: Bearer <key>`.",
            headers={"WWW-Authenticate": "Bearer"},
        )


class AdminKeyRequired(ChatqError):
    """An admin route called without the admin key (or on an API that has none)."""

    status, type = 401, "AuthenticationError"

    def __init__(self) -> None:
        super().__init__(
            "This route needs the admin key (CHATQ_ADMIN_KEY); send it as `Authorization: Bearer <key>`.",
            headers={"WWW-Authenticate": "Bearer"},
        )


class OperatorOnly(ChatqError):
    """A route of the service's operators (loading adapters) called with a managed key."""

    status, type = 403, "PermissionDeniedError"

    def __init__(self) -> None:
        super().__init__("This route needs the admin key or a key of CHATQ_API_KEYS, not a managed key.")


class RequestTooLarge(ChatqError):
    status, type = 413, "RequestTooLargeError"

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than this server accepts ({limit} bytes).")


class QueueFull(ChatqError):
    """Too many jobs wait for a worker of the model: nothing was enqueued; the client retries later."""

    status, type = 429, "RateLimitError"

    def __init__(self, model: str, retry_after: int) -> None:
        super().__init__(
            f"Too many requests are waiting for model `{model}`; retry later.",
            headers={"Retry-After": str(retry_after)},
        )


class RateLimited(ChatqError):
    """A managed key past its requests or tokens per minute, as OpenAI says so: `type` is which, the code
    `rate_limit_exceeded`, and the wait in the message and in `retry-after`."""

    status, code = 429, "rate_limit_exceeded"

    def __init__(self, message: str, type_: str, headers: dict[str, str]) -> None:
        super().__init__(message, headers=headers)
        self.type = type_

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["code"] = self.code
        return body


class InFlightFull(RateLimited):
    """A managed key with as many jobs queued or running as it may have: nothing was enqueued."""

    def __init__(self, cap: int) -> None:
        super().__init__(
            f"Too many requests in flight for this API key: Limit {cap}. Retry once one of them has finished.",
            "requests",
            {"retry-after": "1", "retry-after-ms": "1000"},
        )


class UploadLapsed(ChatqError):
    """An upload that stalled past its lease: the sweep deleted what it had stored, so nothing of it is kept."""

    status, type = 408, "RequestTimeoutError"

    def __init__(self, lease: int) -> None:
        super().__init__(f"The upload stalled for more than {lease} seconds and was dropped; send it again.")


class Conflict(ChatqError):
    status, type = 409, "ConflictError"


class ClientDisconnected(ChatqError):
    """Nginx's 499: nobody reads it, but the access log and the metrics tell it from a served request."""

    status, type = 499, "APIError"


class ServiceUnavailable(ChatqError):
    status, type = 503, "ServiceUnavailableError"


class NoLiveWorker(ServiceUnavailable):
    """The model is registered but none of its workers is live: a request that waits for its answer would hang."""

    def __init__(self, model: str, retry_after: int) -> None:
        super().__init__(
            f"No worker of model `{model}` is running; retry later, or submit with `background: true` to queue the "
            "job until one starts.",
            "model",
            headers={"Retry-After": str(retry_after)},
        )


class RedisUnreachable(ServiceUnavailable):
    def __init__(self) -> None:
        super().__init__("The job store (Redis) is unreachable; retry.", headers={"Retry-After": "1"})


class OutputLost(InternalError):
    """An event of the job never reached its log: a client that resumes meets the same gap, not a hole in the text."""

    def __init__(self) -> None:
        super().__init__("Part of this job's output was lost before it could be relayed.")


class WorkerLost(InternalError):
    def __init__(self, attempts: int):
        super().__init__(
            f"The job's worker stopped while running it, {attempts} times; it is not tried again (CHATQ_MAX_ATTEMPTS)."
        )


class RelayFailed(InternalError):
    def __init__(self) -> None:
        super().__init__("Relaying this job's output failed; resume the stream to read the rest.")
