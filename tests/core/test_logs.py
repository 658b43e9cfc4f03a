"""Log lines in JSON and text, and the job each names: bound in a context, or passed as `extra`."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from chatq.core import logs
from chatq.core.telemetry import TraceIds

TRACE = TraceIds("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")


@pytest.fixture
def json_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    logger = logging.getLogger("chatq.test.logs")
    logger.handlers, logger.propagate = [logs.handler("json", out)], False
    logger.setLevel(logging.INFO)
    yield logger, out
    logger.handlers = []


def _lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_json_line_holds_time_level_logger_message_and_the_bound_job(json_log) -> None:
    logger, out = json_log
    with logs.bound("chatcmpl-1", TRACE):
        logger.warning("job %s is %s", "chatcmpl-1", "late")
    logger.info("not about a job")
    about, other = _lines(out)
    assert about["message"] == "job chatcmpl-1 is late"
    assert (about["level"], about["logger"]) == ("WARNING", "chatq.test.logs")
    assert datetime.fromisoformat(about["time"]).utcoffset().total_seconds() == 0
    assert (about["job_id"], about["trace_id"], about["span_id"]) == ("chatcmpl-1", TRACE.trace_id, TRACE.span_id)
    assert not {"job_id", "trace_id", "span_id"} & set(other)


def test_extra_names_the_job_over_the_bound_one_and_a_traceback_is_kept(json_log) -> None:
    logger, out = json_log
    with logs.bound("chatcmpl-bound", TRACE):
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed", extra=logs.job_extra("chatcmpl-other"))
    (line,) = _lines(out)
    assert line["job_id"] == "chatcmpl-other" and "trace_id" not in line
    assert "ValueError: boom" in line["exc_info"]


def test_a_job_bound_in_one_thread_is_not_named_by_another(json_log) -> None:
    logger, out = json_log
    bound, logged = threading.Event(), threading.Event()

    def job_thread() -> None:
        with logs.bound("chatcmpl-thread"):
            bound.set()
            logged.wait(5)

    t = threading.Thread(target=job_thread)
    t.start()
    bound.wait(5)
    logger.info("the engine loop's own line")
    logged.set()
    t.join()
    assert "job_id" not in _lines(out)[0]
    assert logs.current() == {}


def test_a_text_line_is_plain() -> None:
    out = io.StringIO()
    record = logging.LogRecord("chatq.x", logging.INFO, __file__, 1, "job %s queued", ("chatcmpl-2",), None)
    logs.handler("text", out).handle(record)
    assert out.getvalue().rstrip("\n").endswith("INFO chatq.x: job chatcmpl-2 queued")
