"""The trace context a job keeps: parsed from a request's traceparent, or the API's own span's."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider

from chatq.core import telemetry
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.job import Job
from chatq.core.telemetry import TraceIds

TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


def test_a_traceparent_names_its_trace_and_span() -> None:
    assert telemetry.ids(TRACEPARENT) == TraceIds(TRACE_ID, SPAN_ID)


@pytest.mark.parametrize(
    "header",
    [
        "",
        "garbage",
        f"00-{'0' * 32}-{SPAN_ID}-01",  # an all-zero trace id is invalid
        f"00-{TRACE_ID}-{'0' * 16}-01",
        f"ff-{TRACE_ID}-{SPAN_ID}-01",  # version ff is forbidden
        f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01",
    ],
)
def test_a_missing_or_malformed_traceparent_names_none_and_is_not_kept(header: str) -> None:
    assert telemetry.ids(header) is None
    assert telemetry.job_trace({"traceparent": header} if header else {}) == {}


def test_without_a_span_of_its_own_the_job_keeps_the_requests_trace_context() -> None:
    kept = telemetry.job_trace({"traceparent": TRACEPARENT, "tracestate": "vendor=abc"})
    assert kept == {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}


def test_with_a_server_span_the_job_keeps_that_span_a_child_of_the_requests() -> None:
    tracer = TracerProvider().get_tracer("test")
    headers = {"traceparent": TRACEPARENT}
    with tracer.start_as_current_span("server", context=telemetry.extract(TRACEPARENT)) as span:
        kept = telemetry.job_trace(headers)
    server = telemetry.ids_of(span.get_span_context())
    assert server is not None and server.trace_id == TRACE_ID and server.span_id != SPAN_ID
    assert telemetry.ids(kept["traceparent"]) == server


@pytest.mark.parametrize(
    ("environ", "exporting"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_spans_are_exported_only_to_a_configured_endpoint(environ: dict[str, str], exporting: bool) -> None:
    assert telemetry.exporting(environ) is exporting
    if not exporting:
        assert telemetry.setup("chatq-test", environ) is False


def test_the_job_record_keeps_the_trace_context() -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    job = Job(id="chatcmpl-1", model="m", request=request, traceparent=TRACEPARENT, tracestate="vendor=abc")
    back = Job.from_redis(job.to_redis())
    assert (back.traceparent, back.tracestate) == (TRACEPARENT, "vendor=abc")
    assert "traceparent" not in Job(id="chatcmpl-2", model="m", request=request).to_redis()
