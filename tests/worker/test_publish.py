"""One step's writes: events in the log and on the channel with the same message, and finished jobs expire."""

from __future__ import annotations

import json
import threading

import pytest
import redis

from shared import keys
from shared.protocol import Event, EventKind, JobStatus
from worker.publish import JobEnd, Outbox, Publisher, StepWrites


def test_events_are_logged_and_published_and_finished_jobs_expire(settings):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    job_id = "chatcmpl-publish-test"
    r.hset(keys.job(job_id), mapping={"id": job_id, "status": "in_progress"})
    r.set(keys.cancel(job_id), "1")
    p = r.pubsub()
    p.subscribe(keys.live(job_id))
    p.get_message(timeout=5)
    publisher = Publisher(redis.Redis.from_url(settings.redis_url), settings.model_copy(update={"result_ttl": 30}))
    events = [Event(seq=1, event=EventKind.chunk, data={"x": 1}), Event(seq=2, event=EventKind.done)]
    cancelled = publisher.flush(StepWrites(events=[(job_id, e) for e in events]), running=[job_id])
    assert cancelled == {job_id}
    published = [json.loads(p.get_message(timeout=5)["data"]) for _ in events]
    logged = [json.loads(f["msg"]) for _, f in r.xrange(keys.events(job_id))]
    assert (
        published
        == logged
        == [{"seq": 1, "event": "chunk", "data": {"x": 1}}, {"seq": 2, "event": "done", "data": None}]
    )
    assert [i for i, _ in r.xrange(keys.events(job_id))] == ["0-1", "0-2"]

    publisher.flush(StepWrites(ended=[JobEnd(job_id, JobStatus.completed, 7, result={"ok": True})]), running=[])
    assert r.hget(keys.job(job_id), "status") == "completed"
    assert r.hget(keys.job(job_id), "completion_tokens") == "7"
    for key in (keys.job(job_id), keys.events(job_id), keys.cancel(job_id)):
        assert 0 < r.ttl(key) <= 30


@pytest.mark.parametrize("threaded", [True, False])
def test_outbox_writes_steps_in_order_and_reports_each_once_written(settings, threaded):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    job_id = f"chatcmpl-outbox-test-{threaded}"
    r.set(keys.cancel(job_id), "1")
    outbox = Outbox(Publisher(redis.Redis.from_url(settings.redis_url), settings), threaded=threaded)
    seen: list[tuple[int, int, set[str]]] = []
    for seq in range(1, 51):
        step = StepWrites(events=[(job_id, Event(seq=seq, event=EventKind.chunk, data={"n": seq}))])

        def written(cancelled: set[str], seq: int = seq) -> None:
            seen.append((seq, r.xlen(keys.events(job_id)), cancelled))

        outbox.put(step, [job_id] if seq == 50 else [], written)
    outbox.close()
    # Each step is in the log by the time it is reported, and the reports come in step order.
    assert [(s, n) for s, n, _ in seen] == [(s, s) for s in range(1, 51)]
    assert seen[-1][2] == {job_id} and not any(c for _, _, c in seen[:-1])
    assert [i for i, _ in r.xrange(keys.events(job_id))] == [f"0-{s}" for s in range(1, 51)]


@pytest.mark.parametrize("threaded", [True, False])
def test_a_step_that_cannot_be_written_is_still_reported(settings, threaded):
    done = threading.Event()
    unreachable = Publisher(redis.Redis(port=1, socket_connect_timeout=0.2), settings)
    outbox = Outbox(unreachable, threaded=threaded)
    outbox.put(StepWrites(events=[("chatcmpl-x", Event(seq=1, event=EventKind.done))]), [], lambda _: done.set())
    outbox.close()
    # The job's task is released (it would otherwise hold its Celery slot forever); the error is logged.
    assert done.is_set()
