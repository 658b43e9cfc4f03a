"""The worker's heartbeat: in the live-worker registry only while its engine makes progress, its model's entry written
again whenever it is gone."""

from __future__ import annotations

import dataclasses
import threading
import time

import redis

from bench.zero_engine import ZeroEngine
from chatq.core import keys
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.job import Job
from chatq.core.registry import entry, read_entry
from chatq.worker.celery_app import WorkerState, beat
from chatq.worker.publish import Publisher
from chatq.worker.runner import Runner
from tests.helpers import model_info


class HangingEngine(ZeroEngine):
    """Its steps wait for `release`, as a step stuck in a driver would wait for ever."""

    def __init__(self, token_id: int):
        super().__init__(token_id)
        self.release = threading.Event()

    def step(self):
        self.release.wait()
        return super().step()


def test_a_worker_whose_engine_hangs_leaves_the_registry_until_it_moves_again(settings, r):
    settings = settings.model_copy(update={"model_name": "model-of-a-hanging-worker", "step_timeout": 0.3})
    engine = HangingEngine(token_id=5)
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    info = dataclasses.replace(model_info(10**7, (2,)), name=settings.model_name)
    runner = Runner(lambda: engine, info, Publisher(client, settings, "hanging"), settings=settings)
    state = WorkerState(client, runner, "hanging", entry(info))
    registry = keys.workers(settings.model_name)
    runner.start()
    try:
        assert beat(state, settings) is None and r.zscore(registry, "hanging") is not None
        # Its own entry says how its engine runs, and lives a worker TTL past its last beat.
        own = keys.worker("hanging")
        slots = str(settings.worker_concurrency)  # the jobs it runs at once: its fair-share slots
        assert r.hgetall(own) == {"model": settings.model_name, "device": "cpu", "mode": "zero", "checks": "[]"} | {
            "slots": slots
        }
        assert 0 < r.ttl(own) <= settings.worker_ttl
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        run = runner.submit(Job(id="chatcmpl-hanging", model=settings.model_name, request=request, prompt_ids=[1]))
        # The step began (however long the engine thread took to get to it on a busy machine) and has run past
        # step_timeout.
        deadline = time.monotonic() + 30
        while runner.stepping_since is None:
            assert time.monotonic() < deadline, "the engine never began the step"
            time.sleep(0.01)
        time.sleep(2 * settings.step_timeout)
        stalled = beat(state, settings)
        assert stalled is not None and stalled.startswith("an engine step has been running for")
        assert r.zscore(registry, "hanging") is None and not r.exists(own)
        engine.release.set()
        assert run.done.wait(10)
        assert beat(state, settings) is None and r.zscore(registry, "hanging") is not None
    finally:
        engine.release.set()
        runner.stop()
    assert runner.stalled(settings.step_timeout) == "the engine thread has stopped"
    r.delete(registry, keys.job("chatcmpl-hanging"), keys.events("chatcmpl-hanging"), keys.model(settings.model_name))
    r.delete(keys.worker("hanging"))
    r.srem(keys.models(), settings.model_name)


def test_the_heartbeat_registers_the_model_again_when_redis_lost_its_entry(settings, r):
    settings = settings.model_copy(update={"model_name": "model-whose-entry-goes"})
    info = dataclasses.replace(model_info(), name=settings.model_name)
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    runner = Runner(lambda: ZeroEngine(token_id=5), info, Publisher(client, settings, "w"), settings=settings)
    state = WorkerState(client, runner, "w", entry(info))
    runner.start()
    try:
        assert beat(state, settings) is None
        assert read_entry(r.hgetall(keys.model(settings.model_name)))[0] == info  # a worker's beat writes it
        r.delete(keys.model(settings.model_name))
        r.srem(keys.models(), settings.model_name)
        beat(state, settings)
        assert read_entry(r.hgetall(keys.model(settings.model_name)))[0] == info
        assert settings.model_name in r.smembers(keys.models())
    finally:
        runner.stop()
        r.delete(keys.model(settings.model_name), keys.workers(settings.model_name))
        r.srem(keys.models(), settings.model_name)
