"""Trace context: the W3C `traceparent` a request brings, kept with its job, and OpenTelemetry's export of the spans
of the API and the worker when an OTLP endpoint is configured.

The OTel SDK reads its own standard variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_HEADERS, ...); without an endpoint no provider is set up, and the API's tracer
is OTel's no-op one: spans cost next to nothing, and the traceparent is still parsed, stored and logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

PROPAGATOR = TraceContextTextMapPropagator()
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(frozen=True, slots=True)
class TraceIds:
    """The ids a log line names: 32 and 16 lowercase hex digits, as in a traceparent."""

    trace_id: str
    span_id: str


def exporting(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether spans are exported: an OTLP endpoint is configured and the SDK is not switched off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def setup(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Sets up the OTel SDK exporting over OTLP/HTTP, when an endpoint is configured; whether it did. `service` is
    the service name unless OTEL_SERVICE_NAME gives one (a name passed in would override the variable)."""
    if not exporting(environ):
        return False
    # Imported here: a process that exports nothing never loads the SDK.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = "OTEL_SERVICE_NAME" in environ
    provider = TracerProvider(resource=Resource.create({} if named else {SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def shutdown() -> None:
    """Sends the spans still buffered; for a process about to exit."""
    provider = trace.get_tracer_provider()
    stop = getattr(provider, "shutdown", None)  # the SDK's provider; the API's default has none
    if stop is not None:
        stop()


def extract(traceparent: str, tracestate: str = "") -> Context:
    """The context whose span is the one a (stored) traceparent names; an empty context for none or a malformed one."""
    carrier = {"traceparent": traceparent, "tracestate": tracestate} if traceparent else {}
    return PROPAGATOR.extract(carrier)


def ids(traceparent: str) -> TraceIds | None:
    """The trace and span ids of a traceparent, None for a missing or malformed one."""
    context = trace.get_current_span(extract(traceparent)).get_span_context()
    return ids_of(context)


def ids_of(context: trace.SpanContext) -> TraceIds | None:
    if not context.is_valid:
        return None
    return TraceIds(trace.format_trace_id(context.trace_id), trace.format_span_id(context.span_id))


def job_trace(headers: Mapping[str, str]) -> dict[str, str]:
    """What a submitted job keeps of the request's trace: `traceparent` (and `tracestate`) naming the span the
    worker's spans continue. That is the API's own server span when it is traced, else the request's traceparent,
    as sent (validated: a malformed one is dropped, as OTel's propagator drops it); {} when there is neither."""
    current = trace.get_current_span().get_span_context()
    context = None if current.is_valid else extract(headers.get("traceparent", ""), headers.get("tracestate", ""))
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=context)
    return carrier
