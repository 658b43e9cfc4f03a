"""One attempt at a job as a trace: the span "chatq.generate", child of the span the job's stored traceparent names
(the API's, or the client's), from the job's queueing to its end, with children for its wait in the queue, its
prefill (up to the first token) and its decode; and the job's fields on every line its task thread logs meanwhile.

The spans' times are taken as the job goes (two clock reads per job in the engine loop: when it takes the job in,
and its first token) and the children are made once it ended, in its task thread: the engine loop, which runs every
job's step, makes no span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from opentelemetry import trace

from chatq.core import logs, telemetry
from chatq.core.job import JobStatus

if TYPE_CHECKING:  # the Celery app, Flower's too, imports this module: no torch for it
    from chatq.worker.jobrun import JobRun

log = logging.getLogger(__name__)
tracer = trace.get_tracer("chatq.worker")

NS = 1_000_000_000


class JobTrace:
    """The spans of one attempt, open while it runs."""

    def __init__(self, record: Mapping[str, str], model: str):
        self.claimed = time.time_ns()
        queued_at = record.get("queued_at")
        self.queued = int(float(queued_at) * NS) if queued_at else self.claimed
        parent = telemetry.extract(record.get("traceparent", ""), record.get("tracestate", ""))
        attributes: dict[str, str | int] = {
            "chatq.job_id": record.get("id", ""),
            "chatq.attempt": int(record.get("attempts") or 0),
            "gen_ai.request.model": model,
        }
        kind = trace.SpanKind.CONSUMER
        self.span = tracer.start_span("chatq.generate", parent, kind, attributes, start_time=self.queued)
        self._child("chatq.queue", self.queued, self.claimed)
        # A worker that exports nothing logs the stored trace's ids.
        self.ids = telemetry.ids_of(self.span.get_span_context()) or telemetry.ids(record.get("traceparent", ""))

    def _child(self, name: str, start: int, end: int) -> None:
        tracer.start_span(name, context=trace.set_span_in_context(self.span), start_time=start).end(end_time=end)

    def finish(self, run: JobRun) -> None:
        """Ends the spans, naming what the job came to."""
        end = time.time_ns()
        first_token = int(run.clock.first_token * NS) if run.clock.first_token is not None else None
        self._child("chatq.prefill", max(int(run.clock.started * NS), self.claimed), first_token or end)
        if first_token is not None:
            self._child("chatq.decode", first_token, end)
        status = run.status.value if run.status else "handed over"
        self.span.set_attributes(
            {
                "chatq.status": status,
                "gen_ai.usage.input_tokens": run.job.prompt_tokens,
                "gen_ai.usage.output_tokens": run.completion_tokens,
                "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in run.choices],
            }
        )
        if run.status is JobStatus.failed:
            self.span.set_status(trace.StatusCode.ERROR)
        self.span.end(end_time=end)
        # The job's one line in the worker's log.
        log.info(
            "job %s %s: %d prompt tokens, %d completion tokens, finish %s",
            run.job.id,
            status,
            run.job.prompt_tokens,
            run.completion_tokens,
            ",".join(c.finish_reason or "-" for c in run.choices) or "-",
        )


@contextmanager
def attempt(record: Mapping[str, str], model: str) -> Iterator[JobTrace]:
    """The attempt's spans, current in this thread, and its job named on this thread's log lines, until it ends. A
    span not finished (the attempt raised, or was handed over) ends as it stands."""
    job_trace = JobTrace(record, model)
    with trace.use_span(job_trace.span, end_on_exit=False), logs.bound(record.get("id", ""), job_trace.ids):
        try:
            yield job_trace
        finally:
            if job_trace.span.is_recording():
                job_trace.span.end()
