"""The engine loop running several jobs against a zero-cost engine and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import redis
import redis.asyncio as aioredis
import torch
from tokenizers import Tokenizer

from bench.zero_engine import ZeroEngine
from chatq.api.jobs import JobStore
from chatq.core import keys
from chatq.core.delta import Delta
from chatq.core.errors import JobNotFound
from chatq.core.job import JobStatus
from chatq.core.priority import BATCH_ENGINE_PRIORITY
from chatq.core.queue import make_celery
from chatq.core.settings import Settings
from chatq.worker import jobrun as jobrun_module
from chatq.worker.detokenize import Decoder
from chatq.worker.engine import Finish
from chatq.worker.jobrun import JobRun
from chatq.worker.publish import Publisher
from chatq.worker.runner import Runner
from tests.helpers import cancel_job, model_info
from tests.worker.test_jobrun import ids, job

WORKER = "runner-test@host"


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return Decoder(Tokenizer.from_file(str(Settings().model_dir / "tokenizer.json")))


def test_a_job_whose_output_handling_fails_ends_alone(decoder, settings, r, monkeypatch):
    token = ids(decoder, " hello")[0]
    engine = ZeroEngine(token)
    runner = Runner(
        lambda: engine,
        model_info(10**7, (2,)),  # room for the job that only a cancel ends
        Publisher(redis.Redis.from_url(settings.redis_url, decode_responses=True), settings, WORKER),
        settings=settings,
    )
    names = ("good", "bad", "broken", "unfinished", "cancelled", "stopped", "unencodable")
    good, bad, broken, unfinished, cancelled, stopped, unencodable = (f"chatcmpl-runner-{name}" for name in names)
    handle, make_plan, finish = JobRun.on_output, jobrun_module.plan, JobRun._end

    def on_output(self: JobRun, choice, out):
        # A parser bug, hit by one job's third token and by another's first, whose stop string it had just found.
        # Both fail after events were numbered.
        if (self.job.id, len(choice.seq.output_ids)) in ((bad, 3), (stopped, 1)):
            handle(self, choice, out)
            raise ValueError("parser bug")
        if (self.job.id, len(choice.seq.output_ids)) == (unencodable, 2):
            choice.parser.feed = lambda text: Delta(content="\ud800")  # a string that no UTF-8 encoder takes
        return handle(self, choice, out)

    def plan(req, *args):  # a bug met while preparing one job
        if req.user == broken:
            raise KeyError("no such parser")
        return make_plan(req, *args)

    def end(self: JobRun):  # a bug met while building one job's result
        if self.job.id == unfinished and self.error is None:
            raise RuntimeError("result bug")
        return finish(self)

    monkeypatch.setattr(JobRun, "on_output", on_output)
    monkeypatch.setattr(JobRun, "_end", end)
    monkeypatch.setattr(jobrun_module, "plan", plan)
    jobs = [
        job(stream=True, max_tokens=6, user=job_id).model_copy(update={"id": job_id})
        for job_id in (good, bad, broken, unfinished)
    ] + [
        job(stream=True, max_tokens=10**6).model_copy(update={"id": cancelled}),
        job(stream=True, max_tokens=10**6, stop=["hello"]).model_copy(update={"id": stopped}),
        job(stream=True, max_tokens=6).model_copy(update={"id": unencodable}),
    ]
    for j in jobs:  # as the API's submit and a worker's claim leave them
        r.hset(keys.job(j.id), mapping=j.to_redis() | {"status": "in_progress", "worker": WORKER})
    runner.start()
    try:
        runs = [runner.submit(j) for j in jobs]
        cancel_job(settings, cancelled)
        assert all(run.done.wait(30) for run in runs)
    finally:
        runner.stop()

    def events(job_id: str) -> list[dict]:
        return [json.loads(f["msg"]) for _, f in r.xrange(keys.events(job_id))]

    good_events = events(good)
    text = "".join(e["data"]["choices"][0]["delta"].get("content", "") for e in good_events if e["event"] == "chunk")
    assert text == " hello" * 6
    assert good_events[-1]["event"] == "done" and r.hget(keys.job(good), "status") == "completed"
    bad_events = events(bad)
    assert [e["event"] for e in bad_events[-2:]] == ["error", "done"]
    assert bad_events[-2]["data"]["error"]["message"] == "output processing failed (ValueError)"
    assert r.hget(keys.job(bad), "status") == "failed"
    assert [e["seq"] for e in bad_events] == list(range(1, len(bad_events) + 1))
    assert runs[1].choices[0].seq.finish is Finish.cancelled  # its sequence stopped generating
    stopped_events = events(stopped)
    assert [e["event"] for e in stopped_events[-2:]] == ["error", "done"]
    assert [e["seq"] for e in stopped_events] == list(range(1, len(stopped_events) + 1))
    assert runs[5].choices[0].seq.finish is Finish.cancelled
    broken_events = events(broken)
    assert [e["event"] for e in broken_events] == ["error", "done"]
    assert broken_events[0]["data"]["error"]["message"] == "preparing the job failed (KeyError)"
    assert r.hget(keys.job(broken), "status") == "failed"
    unfinished_events = events(unfinished)
    assert [e["event"] for e in unfinished_events[-2:]] == ["error", "done"]
    assert unfinished_events[-2]["data"]["error"]["message"] == "building the result failed (RuntimeError)"
    assert [e["seq"] for e in unfinished_events] == list(range(1, len(unfinished_events) + 1))
    assert r.hget(keys.job(unfinished), "status") == "failed"
    assert events(cancelled)[-1]["event"] == "done" and r.hget(keys.job(cancelled), "status") == "cancelled"
    # Its events could not be written; the good job's events of the same steps were (its text above is whole).
    unencodable_events = events(unencodable)
    assert [e["event"] for e in unencodable_events[-2:]] == ["error", "done"]
    assert unencodable_events[-2]["data"]["error"]["message"] == "output processing failed (TypeError)"
    assert [e["seq"] for e in unencodable_events] == list(range(1, len(unencodable_events) + 1))
    # What the Celery task returns, and Flower shows.
    assert [run.status for run in runs] == [
        JobStatus.completed,
        JobStatus.failed,
        JobStatus.failed,
        JobStatus.failed,
        JobStatus.cancelled,
        JobStatus.failed,
        JobStatus.failed,
    ]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_cancel_takes_effect_at_the_next_step(decoder, settings, r, threaded):
    """However short the steps: a zero-cost engine makes one a millisecond or so here."""
    engine = ZeroEngine(ids(decoder, " hello")[0])
    if threaded:  # the runner then writes steps from its outbox thread, as on a GPU
        engine.device = torch.device("cuda")
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    runner = Runner(lambda: engine, model_info(10**7, (2,)), Publisher(client, settings, WORKER), settings=settings)
    j = job(stream=True, max_tokens=10**6).model_copy(update={"id": f"chatcmpl-runner-next-step-{threaded}"})
    r.hset(keys.job(j.id), mapping=j.to_redis() | {"status": "in_progress", "worker": WORKER})

    def tokens() -> int:
        return sum(1 for _, f in r.xrange(keys.events(j.id)) if '"content":" hello"' in f["msg"])

    async def cancel_then_count() -> int:
        store = JobStore(
            aioredis.Redis.from_url(settings.redis_url, decode_responses=True), make_celery(settings), settings
        )
        with contextlib.suppress(JobNotFound):  # loads the script, so the cancel below is one round trip
            await store.cancel("chatcmpl-absent")
        while tokens() < 50:
            await asyncio.sleep(0.001)
        await store.cancel(j.id)
        await store.redis.aclose()
        return tokens()

    runner.start()
    try:
        run = runner.submit(j)
        at_cancel = asyncio.run(cancel_then_count())
        assert run.done.wait(10)
    finally:
        runner.stop()
    # Inline, the first write after the cancel landed reads it, and the engine drops the job at the step after: one
    # more token at most. Threaded, up to three more, which the engine made while that write was queued or under way.
    assert tokens() - at_cancel <= (4 if threaded else 1)
    assert r.hget(keys.job(j.id), "status") == "cancelled" and not r.sismember(keys.cancels(WORKER), j.id)
    # The stream ends as the job did: a finish chunk with `abort`, then `done`.
    *_, finish, done = (json.loads(f["msg"]) for _, f in r.xrange(keys.events(j.id)))
    assert finish["data"]["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort", "stop_reason": None}
    ]
    assert done["event"] == "done"


def test_a_job_other_than_a_batch_line_may_stop_the_step_under_way(decoder, settings):
    engine = ZeroEngine(ids(decoder, " hello")[0])
    runner = Runner(
        lambda: engine,
        model_info(),
        Publisher(redis.Redis.from_url(settings.redis_url), settings, WORKER),
        settings=settings,
    )
    runner.engine = engine  # not started: only its intake runs
    line = job().model_copy(update={"id": "chatcmpl-runner-line"})
    line.request.priority = BATCH_ENGINE_PRIORITY
    runner.submit(line)
    assert not engine.urgent.is_set()
    runner.submit(job().model_copy(update={"id": "chatcmpl-runner-interactive"}))
    assert engine.urgent.is_set()
