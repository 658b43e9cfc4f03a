"""A job's clock: its times from the claimed record, and the gaps between each choice's tokens."""

from __future__ import annotations

import pytest

from chatq.core.metrics import ITL, QUEUE_TIME, TTFT, read
from chatq.worker.timing import JobClock

RECORD = {"created": "100", "submitted": "100.5", "queued_at": "130.0", "started": "131.0"}


def test_a_jobs_times_run_from_its_submit_and_each_choice_has_its_own_gaps():
    clock = JobClock.from_record(RECORD, resumed=False)
    for choice, at in ((0, 132.0), (1, 132.0), (0, 132.25), (1, 132.5), (0, 132.5)):
        clock.token(choice, at)
    facts = clock.facts(133.0, prompt_tokens=7, generation_tokens=5, finished_reason="stop")
    assert (facts.e2e, facts.queue_time, facts.ttft) == (32.5, 30.5, 31.5)
    reading = read({k: repr(v) for k, v in facts.increments().items()})
    assert reading.histograms[ITL.name].buckets[-1] == ("+Inf", 3)
    assert reading.histograms[ITL.name].sum == pytest.approx(1.0)


def test_a_job_continued_from_a_log_waited_from_its_requeue_and_has_no_first_token():
    clock = JobClock.from_record(RECORD, resumed=True)
    clock.token(0, 132.0)
    clock.token(0, 132.1)
    facts = clock.facts(133.0, prompt_tokens=7, generation_tokens=2, finished_reason="length")
    assert facts.queue_time == 1.0 and facts.ttft is None
    reading = read({k: repr(v) for k, v in facts.increments().items()})
    assert reading.histograms[TTFT.name].buckets[-1] == ("+Inf", 0)
    assert reading.histograms[QUEUE_TIME.name].buckets[-1] == ("+Inf", 1)


def test_a_record_from_before_submitted_was_kept_starts_at_created():
    record = {k: v for k, v in RECORD.items() if k != "submitted"}
    assert JobClock.from_record(record, resumed=False).submitted == 100.0
