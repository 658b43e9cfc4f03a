"""Jobs of stopped workers queued again, against a real Redis: once however many sweep, failed when out of attempts."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis

from chatq.api.jobs import JobStore
from chatq.core import keys, metrics, worker_scripts
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.job import Event, EventKind, Job, JobStatus
from chatq.core.queue import make_celery, task_fields, task_message
from chatq.worker.publish import Publisher, StepWrites
from chatq.worker.reclaim import hand_back, sweep

LANE = 4


@pytest.fixture
def model_settings(settings, request):
    """Settings of a model of the test's own, so its registry and queues are the test's alone."""
    return settings.model_copy(update={"model_name": f"reclaim-{request.node.name}", "max_attempts": 2})


def running_job(r: redis.Redis, settings, job_id: str, holder: str, events: int = 3) -> None:
    """A job claimed by `holder`, which published `events` chunks of it before it stopped."""
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    job = Job(id=job_id, model=settings.model_name, request=request, prompt_ids=[1, 2])
    r.hset(keys.job(job_id), mapping=job.to_redis())
    assert worker_scripts.claim(r, job_id, settings.model_name, holder, LANE)
    chunks = [(job_id, Event(seq, EventKind.chunk, {"choices": [{"index": 0}]}, [seq])) for seq in range(1, events + 1)]
    Publisher(r, settings, holder).flush(StepWrites(events=chunks))


def alive(r: redis.Redis, settings, *workers: str) -> None:
    r.zadd(keys.workers(settings.model_name), dict.fromkeys(workers, time.time()))


def queued_tasks(r: redis.Redis, settings) -> int:
    return r.llen(keys.celery_lane(keys.celery_queue(settings.model_name), LANE))


def test_a_stopped_workers_job_is_queued_again_once_however_many_sweep(r, model_settings):
    settings, job_id = model_settings, "chatcmpl-reclaim-once"
    running_job(r, settings, job_id, "w@dead#1")
    alive(r, settings, "w@a#2", "w@b#3")
    app = make_celery(settings)
    outcomes: list[dict[str, str]] = []
    sweepers = [threading.Thread(target=lambda: outcomes.append(sweep(r, app, settings))) for _ in range(4)]
    for t in sweepers:
        t.start()
    for t in sweepers:
        t.join()
    assert sorted(map(len, outcomes)) == [0, 0, 0, 1] and {job_id: "queued"} in outcomes
    assert queued_tasks(r, settings) == 1
    record = r.hgetall(keys.job(job_id))
    assert record["status"] == "queued" and "worker" not in record and record["attempts"] == "1"
    assert r.zscore(keys.queued(settings.model_name), job_id) is not None
    assert not r.sismember(keys.running(settings.model_name), job_id)
    assert r.ttl(keys.events(job_id)) == -1  # the log waits with the job for a worker to continue it

    # The job's new task and the dead worker's message, redelivered late: one claim runs it.
    assert worker_scripts.claim(r, job_id, settings.model_name, "w@a#2", LANE)["attempts"] == "2"
    assert worker_scripts.claim(r, job_id, settings.model_name, "w@b#3", LANE) == {}
    assert sweep(r, app, settings) == {}  # its holder is alive


def test_the_stopped_workers_writes_are_refused_once_the_job_moved(r, model_settings):
    settings, job_id = model_settings, "chatcmpl-reclaim-fenced"
    running_job(r, settings, job_id, "w@slow#1")
    alive(r, settings, "w@a#2")
    assert sweep(r, make_celery(settings), settings) == {job_id: "queued"}
    # The worker was only slow (counted out while a step stalled): what it writes now is refused, and it hears so.
    late = Publisher(r, settings, "w@slow#1")
    said = late.flush(StepWrites(events=[(job_id, Event(4, EventKind.chunk, {"late": True}))], progress={job_id: 4}))
    assert said.lost == {job_id}
    assert r.xlen(keys.events(job_id)) == 3 and r.hget(keys.job(job_id), "completion_tokens") == "0"


def test_a_job_out_of_attempts_fails_after_its_log_instead(r, model_settings):
    settings, job_id = model_settings, "chatcmpl-reclaim-spent"
    app = make_celery(settings)
    running_job(r, settings, job_id, "w@first#1")
    idem = keys.idempotency("", job_id)  # as submit writes an Idempotency-Key: kept, without expiry, until the end
    r.set(idem, job_id)
    r.hset(keys.job(job_id), "idem", idem)
    alive(r, settings, "w@second#2")
    assert sweep(r, app, settings) == {job_id: "queued"}
    assert worker_scripts.claim(r, job_id, settings.model_name, "w@second#2", LANE)
    r.zrem(keys.workers(settings.model_name), "w@second#2")  # it dies too, the job's second attempt spent
    alive(r, settings, "w@third#3")
    assert sweep(r, app, settings) == {job_id: "failed"}
    logged = [json.loads(f["msg"]) for _, f in r.xrange(keys.events(job_id))]
    assert [e["seq"] for e in logged] == [1, 2, 3, 4, 5]
    assert [e["event"] for e in logged[3:]] == ["error", "done"]
    error = logged[3]["data"]["error"]
    assert "CHATQ_MAX_ATTEMPTS" in error["message"] and error["code"] == 500
    record = r.hgetall(keys.job(job_id))
    assert record["status"] == "failed" and json.loads(record["error"]) == error
    assert 0 < r.ttl(keys.job(job_id)) <= settings.result_ttl
    assert 0 < r.ttl(idem) <= settings.result_ttl  # the key goes with the record, not left behind
    assert queued_tasks(r, settings) == 1  # only the first requeue's task
    # It ended with an error as far as /metrics tells, once.
    assert metrics.read(r.hgetall(keys.metrics(settings.model_name))).success == {"error": 1}


def test_a_stopping_worker_hands_back_only_its_own_jobs_and_no_attempt_is_counted(r, model_settings):
    settings = model_settings
    running_job(r, settings, "chatcmpl-reclaim-mine", "w@stopping#1")
    running_job(r, settings, "chatcmpl-reclaim-theirs", "w@other#2")
    app = make_celery(settings)
    handed = hand_back(r, app, settings, "w@stopping#1", ["chatcmpl-reclaim-mine", "chatcmpl-reclaim-theirs"])
    assert handed == ["chatcmpl-reclaim-mine"]
    assert r.hget(keys.job("chatcmpl-reclaim-mine"), "attempts") == "0"
    assert r.hget(keys.job("chatcmpl-reclaim-theirs"), "status") == "in_progress"


async def test_a_job_cancelled_while_it_waits_to_continue_closes_its_stream_after_its_log(r, model_settings):
    settings, job_id = model_settings, "chatcmpl-reclaim-cancelled"
    running_job(r, settings, job_id, "w@gone#1")
    alive(r, settings, "w@a#2")
    assert sweep(r, make_celery(settings), settings) == {job_id: "queued"}
    from chatq.api.app import redis_client

    client = redis_client(settings)
    await JobStore(client, make_celery(settings), settings).cancel(job_id)
    await client.aclose()
    logged = [json.loads(f["msg"]) for _, f in r.xrange(keys.events(job_id))]
    assert [e["seq"] for e in logged] == [1, 2, 3, 4, 5]
    assert logged[3]["data"]["choices"][0]["finish_reason"] == "abort" and "role" not in json.dumps(logged[3])
    assert logged[4]["event"] == "done"
    assert r.hget(keys.job(job_id), "status") == JobStatus.cancelled


def test_a_cancel_asked_of_a_stopped_worker_reaches_the_one_that_continues(r, model_settings):
    settings, job_id = model_settings, "chatcmpl-reclaim-cancel-carried"
    running_job(r, settings, job_id, "w@gone#1")
    r.hset(keys.job(job_id), "cancel", "1")  # as the API's cancel leaves a running job
    alive(r, settings, "w@a#2")
    assert sweep(r, make_celery(settings), settings) == {job_id: "queued"}
    assert worker_scripts.claim(r, job_id, settings.model_name, "w@a#2", LANE)
    assert Publisher(r, settings, "w@a#2").flush(StepWrites()).cancelled == {job_id}


def queued_job(r: redis.Redis, settings, job_id: str, age: float) -> tuple[str, str]:
    """A job queued `age` seconds ago, as the API's submit leaves it; its task's queue list and message."""
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    job = Job(id=job_id, model=settings.model_name, request=request, prompt_ids=[1, 2])
    queue, message = task_message(make_celery(settings), job_id, keys.celery_queue(settings.model_name), LANE)
    r.hset(keys.job(job_id), mapping=job.to_redis() | task_fields(queue, message, time.time() - age))
    r.zadd(keys.queued(settings.model_name), {job_id: LANE * 1e11})
    r.lpush(queue, message)
    return queue, message


def test_a_queued_job_whose_task_message_was_lost_gets_it_again_once(r, model_settings):
    settings, app = model_settings, make_celery(model_settings)
    lost, fresh, waiting = "chatcmpl-redeliver-lost", "chatcmpl-redeliver-fresh", "chatcmpl-redeliver-waiting"
    for job_id, age in ((lost, 60), (fresh, 0), (waiting, 60)):
        queue, message = queued_job(r, settings, job_id, age)
        if job_id != waiting:
            r.lrem(queue, 1, message)  # popped by a worker that died before it recorded the delivery
    outcomes: list[dict[str, str]] = []
    sweepers = [threading.Thread(target=lambda: outcomes.append(sweep(r, app, settings))) for _ in range(3)]
    for t in sweepers:
        t.start()
    for t in sweepers:
        t.join()
    # The fresh one may still be on its way to a worker; the waiting one is in its queue.
    assert sorted(map(len, outcomes)) == [0, 0, 1] and {lost: "sent again"} in outcomes
    assert queued_tasks(r, settings) == 2
    assert worker_scripts.claim(r, lost, settings.model_name, "w@a#1", LANE)


def test_a_task_delivered_to_a_worker_that_never_claimed_it_is_sent_again(r, model_settings):
    settings, app = model_settings, make_celery(model_settings)
    job_id = "chatcmpl-redeliver-unacked"
    queue, message = queued_job(r, settings, job_id, 60)
    tag = r.hget(keys.job(job_id), "tag")
    r.lrem(queue, 1, message)
    # As kombu records a delivery: the worker it went to died before claiming the job.
    r.hset(keys.KOMBU_UNACKED, tag, json.dumps([json.loads(message), "", queue]))
    r.zadd(keys.KOMBU_UNACKED_INDEX, {tag: time.time() - 1})
    assert sweep(r, app, settings) == {}  # delivered a moment ago: a live worker is claiming it
    r.zadd(keys.KOMBU_UNACKED_INDEX, {tag: time.time() - 60})
    assert sweep(r, app, settings) == {job_id: "sent again"}
    assert not r.hexists(keys.KOMBU_UNACKED, tag) and queued_tasks(r, settings) == 1


def test_a_job_parked_for_its_fair_share_is_not_sent_again(r, model_settings):
    settings, app = model_settings, make_celery(model_settings)
    job_id = "chatcmpl-redeliver-parked"
    queue, message = queued_job(r, settings, job_id, 60)
    r.lrem(queue, 1, message)
    r.hset(keys.job(job_id), "parked", "1")  # its message waits for a free slot, not in the queue
    assert sweep(r, app, settings) == {}
    r.hdel(keys.job(job_id), "parked")
    assert sweep(r, app, settings) == {job_id: "sent again"}
