"""Log lines, plain text or JSON (CHATQ_LOG_FORMAT), and the job each line concerns.

A line about a job carries `job_id` (and `trace_id`/`span_id` when the job has a trace): taken from a context
variable that the API sets when a request submits or reads a job and a worker's task thread sets while it runs one,
or passed as `extra` (`job_extra`) by threads that serve many jobs at once, such as the worker's engine loop.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, TextIO

if TYPE_CHECKING:
    from chatq.core.telemetry import TraceIds

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers that uvicorn gives handlers of its own, with its own format.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")

_job: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("chatq_job", default=None)


def job_extra(job_id: str, trace: TraceIds | None = None) -> dict[str, str]:
    """The fields of a line about this job, for a log call's `extra`."""
    fields = {"job_id": job_id}
    if trace is not None:
        fields |= {"trace_id": trace.trace_id, "span_id": trace.span_id}
    return fields


def bind(job_id: str, trace: TraceIds | None = None) -> contextvars.Token[dict[str, str] | None]:
    """Names this job on the lines logged from here on in this context (a request's task, a task thread)."""
    return _job.set(job_extra(job_id, trace))


def current() -> dict[str, str]:
    """The job fields bound in this context; {} when none is."""
    return dict(_job.get() or {})


@contextmanager
def bound(job_id: str, trace: TraceIds | None = None) -> Iterator[None]:
    token = bind(job_id, trace)
    try:
        yield
    finally:
        _job.reset(token)


class JobFilter(logging.Filter):
    """Adds the bound job's fields to a record that does not carry them already (from `extra`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _job.get()
        if fields and not hasattr(record, "job_id"):
            record.__dict__.update(fields)
        return True


def json_formatter() -> logging.Formatter:
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, then the record's extra fields (the
    job's among them) and a traceback if any."""
    # Imported here, not above: the engine logs through this module, and runs on GPU machines that have torch and
    # transformers but none of the service's packages (bench/gpu_engine.py).
    from pythonjsonlogger.orjson import OrjsonFormatter

    return OrjsonFormatter(
        "{levelname}{name}{message}",
        style="{",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",
    )


def handler(fmt: Literal["text", "json"], stream: TextIO | None = None) -> logging.Handler:
    """A stream handler (stderr by default) writing lines in the format, with the job's fields."""
    out = logging.StreamHandler(stream or sys.stderr)
    out.setFormatter(json_formatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    out.addFilter(JobFilter())
    return out


def configure(fmt: Literal["text", "json"]) -> None:
    """The root logger of a process that sets up no logging of its own (the API under uvicorn): one handler in the
    format. In JSON, uvicorn's loggers hand their records to it too, so that every line is JSON."""
    root = logging.getLogger()
    root.handlers = [handler(fmt)]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    if fmt == "json":
        for name in UVICORN_LOGGERS:
            logging.getLogger(name).handlers = []
            logging.getLogger(name).propagate = True


def celery_worker(fmt: Literal["text", "json"]) -> None:
    """A Celery worker's logging, set up before Celery's own or Flower's (tornado's): both leave a root logger with a
    handler as it is, so the worker's lines and Flower's are JSON from the first. Celery's two INFO lines per job
    ("received", "succeeded") cost CPU on every job and repeat what the job record and Flower show; failures still
    log at ERROR."""
    for name in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if fmt == "json":
        configure("json")


def adopt(root: logging.Logger, fmt: Literal["text", "json"]) -> None:
    """Fits the handlers another library set up (Celery's) with the job's fields, and in JSON with its format."""
    for h in root.handlers:
        if not any(isinstance(f, JobFilter) for f in h.filters):
            h.addFilter(JobFilter())
        if fmt == "json":
            h.setFormatter(json_formatter())
    logging.captureWarnings(True)
