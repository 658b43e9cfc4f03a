"""Logs and traces of a running stack: JSON log lines naming the job and its trace in the API's and the worker's
logs, and the spans both export over OTLP/HTTP, to a receiver the tests run, continuing the client's traceparent."""

from __future__ import annotations

import gzip
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import running_stack


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    start: int
    end: int


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: the spans of every POST /v1/traces."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                with self.lock:
                    self.spans.extend(_span(service, s) for s in scope_spans.spans)

    def wait(self, found: Callable[[list[Span]], bool], timeout: float = 30) -> list[Span]:
        deadline = time.time() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if found(spans):
                return spans
            assert time.time() < deadline, f"spans never arrived; got {[(s.service, s.name) for s in spans]}"
            time.sleep(0.1)


def _span(service: str, s: Any) -> Span:
    attributes = {a.key: _value(a.value) for a in s.attributes}
    return Span(
        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), attributes,
        s.start_time_unix_nano, s.end_time_unix_nano,
    )  # fmt: skip


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/traces":
            self.server.take(body)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *_args: Any) -> None:
        pass


@dataclass
class Traced:
    base: str
    logs: Path
    receiver: Receiver


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    server = EmbeddedRedis(tmp_path_factory.mktemp("traced-redis"), persist=False).start()
    settings = Settings(redis_url=server.url, api_port=free_port(), worker_concurrency=4, log_format="json")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}",
        # Batches leave every 100 ms rather than every 5 s, so the tests wait less for them.
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    logs = tmp_path_factory.mktemp("traced-logs")
    try:
        with running_stack(settings, logs, env) as base:
            yield Traced(base, logs, receiver)
    finally:
        server.stop()
        receiver.shutdown()


def _chat(base: str, headers: dict[str, str]) -> str:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    resp = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _of_job(job_id: str) -> Callable[[list[Span]], bool]:
    """Found once the job's generate span and the span it continues have both come: each process exports its own,
    in its own time."""

    def found(spans: list[Span]) -> bool:
        ids = {s.span_id for s in spans}
        return any(
            s.name == "chatq.generate" and s.attributes.get("chatq.job_id") == job_id and s.parent_id in ids
            for s in spans
        )

    return found


def test_the_workers_spans_continue_the_requests_traceparent(traced: Traced) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    job_id = _chat(traced.base, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    spans = [s for s in traced.receiver.wait(_of_job(job_id)) if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}
    generate = next(s for s in spans if s.name == "chatq.generate")
    assert generate.service == "chatq-worker"
    assert generate.attributes["chatq.status"] == "completed"
    assert generate.attributes["gen_ai.usage.output_tokens"] == 4
    assert generate.attributes["gen_ai.response.finish_reasons"] == ["length"]
    # worker -> the API's server span -> the client's span
    server = by_id[generate.parent_id]
    assert (server.service, server.name, server.parent_id) == ("chatq-api", "POST /v1/chat/completions", client_span)
    children = {s.name: s for s in spans if s.parent_id == generate.span_id}
    assert set(children) == {"chatq.queue", "chatq.prefill", "chatq.decode"}
    queue, prefill, decode = children["chatq.queue"], children["chatq.prefill"], children["chatq.decode"]
    assert generate.start == queue.start <= queue.end <= prefill.start <= prefill.end == decode.start <= decode.end
    assert decode.end == generate.end


def test_a_request_without_traceparent_gets_the_apis_trace(traced: Traced) -> None:
    job_id = _chat(traced.base, {})
    spans = traced.receiver.wait(_of_job(job_id))
    generate = next(s for s in spans if s.name == "chatq.generate" and s.attributes["chatq.job_id"] == job_id)
    server = next(s for s in spans if s.span_id == generate.parent_id)
    assert (server.service, server.trace_id, server.parent_id) == ("chatq-api", generate.trace_id, "")


def _lines(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    assert lines, f"{path.name} is empty"
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line in {path.name}: {line!r}")
    return parsed


def _about(path: Path, job_id: str, timeout: float = 30) -> list[dict[str, Any]]:
    """The lines whose message names the job, once there is one (the worker logs the job's end after answering)."""
    deadline = time.time() + timeout
    while True:
        about = [line for line in _lines(path) if job_id in line["message"]]
        if about or time.time() > deadline:
            return about
        time.sleep(0.1)


def test_json_logs_name_the_job_and_its_trace_in_the_api_and_the_worker(traced: Traced) -> None:
    trace_id = secrets.token_hex(16)
    job_id = _chat(traced.base, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    for name in ("api.log", "worker.log"):
        about = _about(traced.logs / name, job_id)
        assert about, f"{name} has no line about {job_id}"
        for line in about:
            assert {"time", "level", "logger", "message"} <= set(line), line
            assert (line["job_id"], line["trace_id"]) == (job_id, trace_id), line
            assert len(line["span_id"]) == 16
    ended = _about(traced.logs / "worker.log", job_id)[-1]["message"]
    assert ended.startswith(f"job {job_id} completed: ") and "4 completion tokens" in ended, ended
