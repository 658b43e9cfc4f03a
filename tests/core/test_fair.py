"""The fair share's Lua functions in a real Redis: who is dispatched next, into how many free slots, in which lane's
order, and what a job is charged."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis
import redis.asyncio as aioredis

from chatq.core import fair, keys
from chatq.core.lua import Script

_PARK = Script(
    keys=("waiting", "parked", "service", "clock"),
    args=("owner", "job_id"),
    uses=(fair.FAIR_PARK,),
    body="fair_park(waiting, parked, service, clock, owner, job_id)",
)


class Model:
    """One model's queue in Redis, with live workers of `slots` each."""

    def __init__(self, r: redis.Redis, settings, *slots: int):
        self.r, self.settings = r, settings
        self.name = f"fair-{uuid.uuid4().hex[:8]}"
        for i, n in enumerate(slots):
            worker = f"{self.name}-w{i}"
            r.zadd(keys.workers(self.name), {worker: time.time()})
            r.hset(keys.worker(worker), "slots", n)

    def submit(self, owner: str, lane: int = 5, cost: float = 10, weight: float = 1) -> str:
        job_id = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        task = {"task_queue": keys.celery_lane(keys.celery_queue(self.name), lane), "task": f"message of {job_id}"}
        record = {"status": "queued", "parked": "1", "cost": cost, "weight": weight} | task
        self.r.hset(keys.job(job_id), mapping=record)
        names = (keys.fair_waiting(self.name, lane), keys.fair_parked(self.name, lane, owner))
        self.r.eval(_PARK.source, 4, *names, keys.fair_service(self.name), keys.fair_clock(self.name), owner, job_id)
        return job_id

    def dispatch(self) -> list[str]:
        """The jobs dispatched, in the order they went."""
        before = set(self.r.smembers(keys.dispatched(self.name)))

        async def go() -> int:
            client = aioredis.Redis.from_url(self.settings.redis_url, decode_responses=True)
            try:
                return await fair.dispatch(client, self.name, time.time(), 15)
            finally:
                await client.aclose()

        asyncio.run(go())
        sent = set(self.r.smembers(keys.dispatched(self.name))) - before
        messages = [
            m for lane in range(11) for m in self.r.lrange(keys.celery_lane(keys.celery_queue(self.name), lane), 0, -1)
        ]
        order = [m.removeprefix("message of ") for m in reversed(messages)]
        return [j for j in order if j in sent]

    def claim(self, job_id: str) -> None:
        self.r.srem(keys.dispatched(self.name), job_id)
        self.r.sadd(keys.running(self.name), job_id)
        self.r.hset(keys.job(job_id), "status", "in_progress")

    def end(self, job_id: str) -> None:
        self.r.srem(keys.running(self.name), job_id)
        self.r.hset(keys.job(job_id), "status", "completed")


def test_a_key_with_one_job_goes_before_another_keys_many(r, settings):
    m = Model(r, settings, 2)
    a = [m.submit("a") for _ in range(5)]
    assert m.dispatch() == a[:2]  # two free slots: the first two go
    b = m.submit("b")
    assert m.dispatch() == []  # no slot is free
    m.claim(a[0])
    m.end(a[0])
    assert m.dispatch() == [b]  # the freed slot goes to the key served least, not to the queue's order
    m.claim(a[1]), m.end(a[1])
    assert m.dispatch() == [a[2]]


def test_weights_share_the_slots(r, settings):
    m = Model(r, settings, 1)
    heavy = [m.submit("heavy", weight=3) for _ in range(30)]
    light = [m.submit("light") for _ in range(30)]
    went = []
    for _ in range(40):
        (job,) = m.dispatch()
        went.append(job)
        m.claim(job), m.end(job)
    share = sum(j in heavy for j in went) / sum(j in light for j in went)
    assert 2.6 <= share <= 3.4 and set(went) <= set(heavy) | set(light)


def test_lanes_keep_their_strict_order(r, settings):
    m = Model(r, settings, 1)
    background = m.submit("a", lane=5)
    m.r.hset(keys.worker(f"{m.name}-w0"), "slots", 0)  # busy while both arrive
    interactive = m.submit("b", lane=0)
    m.r.hset(keys.worker(f"{m.name}-w0"), "slots", 1)
    assert m.dispatch() == [interactive]
    m.claim(interactive), m.end(interactive)
    assert m.dispatch() == [background]


def test_an_idle_key_banks_no_credit(r, settings):
    m = Model(r, settings, 1)
    for _ in range(3):  # "a" is served alone for a while
        job = m.submit("a", cost=100)
        (went,) = m.dispatch()
        m.claim(went), m.end(went)
    a_next = m.submit("a", cost=100)
    m.r.hset(keys.worker(f"{m.name}-w0"), "slots", 0)
    late = [m.submit("late", cost=100) for _ in range(3)]
    m.r.hset(keys.worker(f"{m.name}-w0"), "slots", 1)
    # "late" starts level with "a" (300 served), not at 0: it does not take the next three slots in a row.
    went = []
    for _ in range(4):
        (job,) = m.dispatch()
        went.append(job)
        m.claim(job), m.end(job)
    assert sorted(went) == sorted([a_next, *late]) and went[-1] == late[-1]
    assert went[:2] != late[:2]  # "late" started level with "a" (300 served), not at 0: not two slots in a row


def test_a_cancelled_parked_job_is_skipped_and_a_dead_worker_has_no_slots(r, settings):
    m = Model(r, settings, 1)
    first, second = m.submit("a"), m.submit("a")
    r.hset(keys.job(first), "status", "cancelled")
    assert m.dispatch() == [second]
    r.hset(keys.job(second), "status", "cancelled")  # cancelled after its dispatch: it frees its slot
    third = m.submit("a")
    assert m.dispatch() == [third]
    r.zadd(keys.workers(m.name), {f"{m.name}-w0": time.time() - 60})
    m.claim(third), m.end(third)
    m.submit("a")
    assert m.dispatch() == []
