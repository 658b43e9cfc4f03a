"""One step's writes: events in the log and on the channel with the same message, and finished jobs expire."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import redis

from chatq.core import keys, worker_scripts
from chatq.core.job import Event, EventKind, JobStatus
from chatq.embedded_redis import EmbeddedRedis
from chatq.worker.publish import JobEnd, Outbox, Publisher, StepWrites, Written
from tests.helpers import cancel_job


def publisher(settings, worker: str = "w@test", client: redis.Redis | None = None) -> Publisher:
    client = client or redis.Redis.from_url(settings.redis_url, decode_responses=True)
    return Publisher(client, settings, worker)


def test_events_are_logged_and_published_and_finished_jobs_expire(settings):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    job_id = "chatcmpl-publish-test"
    r.hset(keys.job(job_id), mapping={"id": job_id, "status": "in_progress"})
    p = r.pubsub()
    p.subscribe(keys.live(job_id))
    p.get_message(timeout=5)
    pub = publisher(settings.model_copy(update={"result_ttl": 30}))
    events = [Event(seq=1, event=EventKind.chunk, data={"x": 1}), Event(seq=2, event=EventKind.done)]
    pub.flush(StepWrites(events=[(job_id, e) for e in events]))
    published = [json.loads(p.get_message(timeout=5)["data"]) for _ in events]
    logged = [json.loads(f["msg"]) for _, f in r.xrange(keys.events(job_id))]
    assert (
        published
        == logged
        == [{"seq": 1, "event": "chunk", "data": {"x": 1}}, {"seq": 2, "event": "done", "data": None}]
    )
    assert [i for i, _ in r.xrange(keys.events(job_id))] == ["0-1", "0-2"]

    # While the job runs, each progress write refreshes its log's expiry: a worker that vanished leaves nothing forever.
    pub.flush(StepWrites(progress={job_id: 3}))
    assert 0 < r.ttl(keys.events(job_id)) <= 30 and r.ttl(keys.job(job_id)) == -1
    pub.flush(StepWrites(ended=[JobEnd(job_id, JobStatus.completed, 7, result={"ok": True})]))
    assert r.hget(keys.job(job_id), "status") == "completed"
    assert r.hget(keys.job(job_id), "completion_tokens") == "7"
    for key in (keys.job(job_id), keys.events(job_id)):
        assert 0 < r.ttl(key) <= 30


def claim(r: redis.Redis, job_id: str, worker: str) -> dict[str, str]:
    """As chatq.worker.celery_app's task claims a job."""
    return worker_scripts.claim(r, job_id, "m", worker)


def test_every_step_reads_the_cancels_of_its_workers_running_jobs(settings):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    mine, other, queued = "chatcmpl-cancel-mine", "chatcmpl-cancel-other", "chatcmpl-cancel-queued"
    for job_id, worker in ((mine, "w@a"), (other, "w@b"), (queued, None)):
        r.hset(keys.job(job_id), mapping={"id": job_id, "status": "queued"})
        if worker:
            assert claim(r, job_id, worker)
    a, b = publisher(settings, "w@a"), publisher(settings, "w@b")
    assert a.flush(StepWrites()).cancelled == set()
    for job_id in (mine, other, queued):
        cancel_job(settings, job_id)
    # Each worker hears of its own job at its next write, whatever that step carries, and again until the job ends.
    assert a.flush(StepWrites()).cancelled == a.flush(StepWrites(progress={mine: 3})).cancelled == {mine}
    assert b.flush(StepWrites()).cancelled == {other}
    assert r.hget(keys.job(queued), "status") == "cancelled"  # a queued job is cancelled where it waits
    assert a.flush(StepWrites(ended=[JobEnd(mine, JobStatus.cancelled, 3)])).cancelled == set()
    assert a.flush(StepWrites()).cancelled == set() and b.flush(StepWrites()).cancelled == {other}

    # The job is deleted while its worker is gone, and its id submitted again: the new job is not cancelled for it.
    cancel_job(settings, other)
    r.delete(keys.job(other))
    r.hset(keys.job(other), mapping={"id": other, "status": "queued"})
    assert claim(r, other, "w@b")
    assert b.flush(StepWrites()).cancelled == set()

    # A running record that names no worker cannot be cancelled: said, rather than answered as done.
    r.hset(keys.job("chatcmpl-cancel-nameless"), mapping={"id": "chatcmpl-cancel-nameless", "status": "in_progress"})
    with pytest.raises(redis.ResponseError, match="names no worker"):
        cancel_job(settings, "chatcmpl-cancel-nameless")


def test_a_job_deleted_while_running_goes_with_its_last_write(settings):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    job_id, worker = "chatcmpl-publish-deleted", "w@deleted"
    r.hset(keys.job(job_id), mapping={"id": job_id, "status": "queued"})
    assert claim(r, job_id, worker)
    pub = publisher(settings, worker)
    pub.flush(StepWrites(events=[(job_id, Event(seq=1, event=EventKind.chunk, data={"n": 1}))]))
    cancel_job(settings, job_id, delete=True)
    # Hidden from readers, but its id stays taken while its worker still writes: a job submitted again under it would
    # share its log.
    assert pub.flush(StepWrites(progress={job_id: 3})).cancelled == {job_id}
    assert r.hget(keys.job(job_id), "deleted") == "1" and r.hget(keys.job(job_id), "completion_tokens") is None
    assert r.xlen(keys.events(job_id)) == 1
    ended = StepWrites(
        events=[(job_id, Event(seq=2, event=EventKind.done))], ended=[JobEnd(job_id, JobStatus.cancelled, 3)]
    )
    assert pub.flush(ended).cancelled == set()
    assert not r.exists(keys.job(job_id)) and not r.exists(keys.events(job_id))
    # Sent again, as after a reply lost on its way back: the log stays gone, or a job submitted again under the id
    # would meet the old run's events (and its own, numbered the same, would be skipped).
    pub.flush(ended)
    assert not r.exists(keys.job(job_id)) and not r.exists(keys.events(job_id))
    # A record gone altogether is not brought back by the writes of a run that outlived it.
    pub.flush(StepWrites(progress={job_id: 4}))
    pub.flush(StepWrites(ended=[JobEnd(job_id, JobStatus.cancelled, 4)]))
    assert not r.exists(keys.job(job_id))


@pytest.mark.parametrize("threaded", [True, False])
def test_outbox_writes_steps_in_order_and_reports_each_once_written(settings, threaded):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    job_id = f"chatcmpl-outbox-test-{threaded}"
    worker = f"w@outbox-{threaded}"
    r.hset(keys.job(job_id), mapping={"id": job_id, "status": "in_progress"})
    outbox = Outbox(publisher(settings, worker), threaded=threaded)
    seen: list[tuple[int, int, set[str]]] = []
    for seq in range(1, 51):
        step = StepWrites(events=[(job_id, Event(seq=seq, event=EventKind.chunk, data={"n": seq}))])

        def written(said: Written, seq: int = seq) -> None:
            seen.append((seq, r.xlen(keys.events(job_id)), said.cancelled))

        if seq == 50:
            r.sadd(keys.cancels(worker), job_id)
        outbox.put(step, written)
    outbox.close()
    # Each step is in the log by the time it is reported, and the reports come in step order.
    assert [(s, n) for s, n, _ in seen] == [(s, s) for s in range(1, 51)]
    # The cancel, set just before the last step was handed over, reaches that step's report and at most the reports
    # of the steps still queued (threaded) before it.
    reported = [s for s, _, c in seen if c == {job_id}]
    assert reported == list(range(reported[0], 51)) and reported[0] >= 50 - (3 if threaded else 0)
    assert [i for i, _ in r.xrange(keys.events(job_id))] == [f"0-{s}" for s in range(1, 51)]


def test_a_step_sent_again_is_written_and_published_once(settings):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    job_id = "chatcmpl-publish-twice"
    r.hset(keys.job(job_id), mapping={"id": job_id, "status": "in_progress"})
    pub = publisher(settings)
    listener = r.pubsub()
    listener.subscribe(keys.live(job_id))
    assert listener.get_message(timeout=5)["type"] == "subscribe"
    step = StepWrites(events=[(job_id, Event(seq=s, event=EventKind.chunk, data={"n": s})) for s in (1, 2)])
    pub.flush(step)
    pub.flush(step)  # as after a reply lost on its way back
    again = StepWrites(events=[(job_id, Event(seq=s, event=EventKind.chunk, data={"n": s})) for s in (2, 3)])
    pub.flush(again)  # overlapping: only the new event goes out
    # The three expected messages, however late a busy Redis writes them out; then a quiet moment in which any
    # duplicate would have come.
    got = [Event.from_json(listener.get_message(timeout=5)["data"]).seq for _ in range(3)]
    while (m := listener.get_message(timeout=0.2)) is not None:
        got.append(Event.from_json(m["data"]).seq)
    assert got == [1, 2, 3]
    assert [i for i, _ in r.xrange(keys.events(job_id))] == ["0-1", "0-2", "0-3"]


@pytest.mark.parametrize("threaded", [True, False])
def test_a_step_is_sent_again_until_redis_is_back(tmp_path, settings, threaded):
    server = EmbeddedRedis(tmp_path).start()
    port = server.port
    client = redis.Redis(port=port, socket_connect_timeout=0.2, decode_responses=True)
    client.hset(
        keys.job("chatcmpl-retry"), mapping={"id": "chatcmpl-retry", "status": "in_progress"}
    )  # kept across the restart, as the server persists
    outbox = Outbox(publisher(settings, client=client), threaded=threaded)
    server.stop()
    written = threading.Event()
    step = StepWrites(events=[("chatcmpl-retry", Event(seq=1, event=EventKind.done))])
    # Inline, put itself waits for Redis: call it from the thread an engine would.
    threading.Thread(target=outbox.put, args=(step, lambda _: written.set()), daemon=True).start()
    time.sleep(0.5)
    assert not written.is_set()
    server = EmbeddedRedis(tmp_path)
    server.port = port  # the same port, though the old one's connections may still hold it in TIME_WAIT
    server.start()
    try:
        assert written.wait(10)
        assert client.xlen(keys.events("chatcmpl-retry")) == 1
    finally:
        outbox.close()
        server.stop()


def test_a_step_waits_while_redis_is_out_of_memory(tmp_path, settings):
    server = EmbeddedRedis(tmp_path, persist=False).start()
    client = redis.Redis(port=server.port, decode_responses=True)
    outbox = Outbox(publisher(settings, client=client), threaded=True)
    try:
        client.hset(keys.job("chatcmpl-oom"), mapping={"id": "chatcmpl-oom", "status": "in_progress"})
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # below what it uses: every write is refused
        written = threading.Event()
        outbox.put(StepWrites(events=[("chatcmpl-oom", Event(seq=1, event=EventKind.done))]), lambda _: written.set())
        time.sleep(0.5)
        assert not written.is_set()
        client.config_set("maxmemory", 0)
        assert written.wait(10)
        assert client.xlen(keys.events("chatcmpl-oom")) == 1
    finally:
        outbox.close()
        server.stop()


def test_a_step_waits_while_redis_is_a_read_only_replica(tmp_path, settings, redis_server):
    server = EmbeddedRedis(tmp_path, persist=False).start()
    client = redis.Redis(port=server.port, decode_responses=True)
    outbox = Outbox(publisher(settings, client=client), threaded=True)
    try:
        # On both: once it syncs, a replica holds its primary's data.
        for c in (client, redis.Redis(port=redis_server.port)):
            c.hset(keys.job("chatcmpl-ro"), mapping={"id": "chatcmpl-ro", "status": "in_progress"})
        client.replicaof("127.0.0.1", redis_server.port)  # as after a failover demoted it
        written = threading.Event()
        # Events only: the refusal comes from inside the publish script, not when the transaction is queued.
        outbox.put(StepWrites(events=[("chatcmpl-ro", Event(seq=1, event=EventKind.done))]), lambda _: written.set())
        time.sleep(0.5)
        assert not written.is_set()
        client.replicaof("NO", "ONE")
        assert written.wait(10)
        assert client.xlen(keys.events("chatcmpl-ro")) == 1
    finally:
        outbox.close()
        server.stop()


def test_a_step_waits_while_redis_refuses_writes_after_a_failed_save(tmp_path, settings):
    data = tmp_path / "data"
    server = EmbeddedRedis(data, persist=False).start()
    client = redis.Redis(port=server.port, decode_responses=True)
    outbox = Outbox(publisher(settings, client=client), threaded=True)
    job_id = "chatcmpl-misconf"
    try:
        client.hset(keys.job(job_id), mapping={"id": job_id, "status": "in_progress"})
        client.config_set("save", "3600 1")  # refusing writes after a failed save is for servers that save
        shutil.rmtree(data)  # as a full or failing disk: the save fails, and Redis refuses writes (MISCONF)
        client.bgsave()
        while client.info("persistence")["rdb_bgsave_in_progress"]:
            time.sleep(0.05)
        with pytest.raises(redis.ResponseError, match="MISCONF"):
            client.set("probe", 1)
        written = threading.Event()
        step = StepWrites(
            events=[(job_id, Event(seq=1, event=EventKind.done))], ended=[JobEnd(job_id, JobStatus.completed, 1)]
        )
        outbox.put(step, lambda _: written.set())
        time.sleep(0.5)
        assert not written.is_set()
        client.config_set("stop-writes-on-bgsave-error", "no")  # as an operator lifts the refusal
        assert written.wait(10)
        assert client.xlen(keys.events(job_id)) == 1 and client.hget(keys.job(job_id), "status") == "completed"
    finally:
        outbox.close()
        server.stop()


@pytest.mark.parametrize("threaded", [True, False])
def test_steps_are_released_when_redis_refuses_them_or_is_gone_at_shutdown(settings, threaded):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    job_id, other = f"chatcmpl-refused-{threaded}", f"chatcmpl-refused-other-{threaded}"
    worker = f"w@refused-{threaded}"
    r.set(keys.job(job_id), "not a hash")
    r.sadd(keys.cancels(worker), other)
    refused, gone = threading.Event(), threading.Event()
    reported: list[set[str]] = []
    outbox = Outbox(publisher(settings, worker), threaded=threaded)
    step = StepWrites(
        events=[(job_id, Event(seq=1, event=EventKind.done))], ended=[JobEnd(job_id, JobStatus.completed, 1)]
    )
    outbox.put(step, lambda said: (reported.append(said.cancelled), refused.set()))
    outbox.close()
    unreachable = Outbox(publisher(settings, client=redis.Redis(port=1, socket_connect_timeout=0.2)), threaded=threaded)
    step = StepWrites(events=[("chatcmpl-x", Event(seq=1, event=EventKind.done))])
    if threaded:
        # put returns at once (the outbox's thread retries the step). From a thread of its own it could come after
        # the close on a busy machine, into a queue no one reads any more.
        unreachable.put(step, lambda _: gone.set())
    else:  # inline, put retries until the close: call it from the thread an engine would
        threading.Thread(target=unreachable.put, args=(step, lambda _: gone.set()), daemon=True).start()
    time.sleep(0.3)
    unreachable.close()
    # Each job's task is released (it would otherwise hold its Celery slot forever); the errors are logged. What
    # Redis did take of the refused step stands, the cancels among it.
    assert refused.wait(5) and gone.wait(5)
    assert r.xlen(keys.events(job_id)) == 1
    assert reported == [{other}]


def test_a_log_that_refuses_events_costs_only_its_own_job(settings):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    broken, fine = "chatcmpl-broken-log", "chatcmpl-fine-log"
    r.set(keys.events(broken), "not a stream")
    for job_id in (broken, fine):
        r.hset(keys.job(job_id), mapping={"id": job_id, "status": "in_progress"})
    worker = "w@broken-log"
    r.sadd(keys.cancels(worker), fine)
    listener = r.pubsub()
    listener.subscribe(keys.live(broken), keys.live(fine))
    for _ in range(2):
        assert listener.get_message(timeout=5)["type"] == "subscribe"
    step = StepWrites(
        events=[(job_id, Event(seq=1, event=EventKind.chunk, data={"n": 1})) for job_id in (broken, fine)]
    )
    # The cancels are read whatever else the step met.
    assert publisher(settings, worker).flush(step).cancelled == {fine}
    live = [listener.get_message(timeout=5) for _ in range(2)]
    assert sorted(m["channel"] for m in live) == sorted([keys.live(broken), keys.live(fine)])
    assert r.xlen(keys.events(fine)) == 1 and r.type(keys.events(broken)) == "string"


def test_an_ended_jobs_metrics_are_added_once_and_only_by_its_holder(settings):
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    model = "publish-metrics-model"
    r.delete(keys.metrics(model))
    mine, lost = "chatcmpl-metrics-mine", "chatcmpl-metrics-lost"
    for job_id, worker in ((mine, "w@a"), (lost, "w@b")):
        r.hset(keys.job(job_id), mapping={"id": job_id, "status": "queued"})
        assert worker_scripts.claim(r, job_id, model, worker)
    pub = publisher(settings.model_copy(update={"model_name": model}), "w@a")
    added = {"generation_tokens": 5, "success:length": 1, "e2e:sum": 0.25}
    ends = [JobEnd(job_id, JobStatus.completed, 5, metrics=added) for job_id in (mine, lost)]
    # The same step sent again, as after a reply lost on its way back: the job ended already and counts once.
    assert pub.flush(StepWrites(ended=ends)).lost == {lost}
    assert pub.flush(StepWrites(ended=ends[:1])).lost == set()
    assert {k: float(v) for k, v in r.hgetall(keys.metrics(model)).items()} == added
