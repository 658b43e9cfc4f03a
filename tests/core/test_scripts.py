"""The scripts' declarations: every body reads its keys and arguments by name, a misnamed argument is refused, Lua's
event envelope reads back as the Event it names. The submit script against a real Redis: the cap on waiting jobs and
idempotency keys, each in one atomic step, and the idempotency key's expiry when its job ends or is deleted."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from chatq.core import api_scripts, keys, lua, metrics, reclaim_scripts, worker_scripts
from chatq.core.api_scripts import Outcome
from chatq.core.job import Event, EventKind
from chatq.core.lua import LuaFunction, Script
from chatq.core.queue import BATCH_LANE, lane_score
from chatq.core.settings import Settings


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    yield c
    await c.aclose()


def _model() -> str:
    return f"no-worker-{uuid.uuid4().hex[:8]}"  # no worker serves it: whatever is queued stays queued


async def _submit(
    client: aioredis.Redis,
    model: str,
    cap: int = 0,
    idem: str | None = None,
    job_id: str | None = None,
    score: float = 1.0,
) -> api_scripts.Submitted:
    job_id = job_id or f"chatcmpl-{uuid.uuid4().hex}"
    record = {"id": job_id, "model": model, "status": "queued"}
    return await api_scripts.submit(client, job_id, model, record, keys.celery_queue(model), "msg", score, cap, idem)


def _enqueued(r: redis.Redis, model: str) -> tuple[int, int]:
    """Jobs in the model's waiting set, and task messages in its Celery list."""
    return r.zcard(keys.queued(model)), r.llen(keys.celery_queue(model))


async def test_exactly_the_cap_of_concurrent_submits_is_queued(client: aioredis.Redis, r: redis.Redis):
    model = _model()
    results = await asyncio.gather(*(_submit(client, model, cap=10) for _ in range(60)))
    queued = [s for s in results if s.outcome is Outcome.queued]
    full = [s for s in results if s.outcome is Outcome.full]
    assert (len(queued), len(full)) == (10, 50)
    assert _enqueued(r, model) == (10, 10)
    assert not any(r.exists(keys.job(s.job_id)) for s in full)


async def test_running_jobs_do_not_count_against_the_cap(client: aioredis.Redis, r: redis.Redis):
    model = _model()
    first = await _submit(client, model, cap=1)
    assert (await _submit(client, model, cap=1)).outcome is Outcome.full
    r.zrem(keys.queued(model), first.job_id)  # what a worker's claim does
    assert (await _submit(client, model, cap=1)).outcome is Outcome.queued


async def test_batch_lines_do_not_count_against_the_cap(client: aioredis.Redis):
    model = _model()
    line = lane_score(BATCH_LANE, 1.0)
    assert {(await _submit(client, model, cap=1, score=line)).outcome for _ in range(5)} == {Outcome.queued}
    assert (await _submit(client, model, cap=1)).outcome is Outcome.queued
    assert (await _submit(client, model, cap=1)).outcome is Outcome.full


async def test_no_cap_when_zero(client: aioredis.Redis, r: redis.Redis):
    model = _model()
    results = await asyncio.gather(*(_submit(client, model, cap=0) for _ in range(20)))
    assert {s.outcome for s in results} == {Outcome.queued}


async def test_a_taken_id_is_refused_and_left_alone(client: aioredis.Redis, r: redis.Redis):
    model = _model()
    first = await _submit(client, model)
    again = await _submit(client, model, job_id=first.job_id)
    assert again.outcome is Outcome.taken and _enqueued(r, model) == (1, 1)


async def test_one_idempotency_key_makes_one_job_however_many_race(client: aioredis.Redis, r: redis.Redis):
    model, idem = _model(), keys.idempotency("owner-a", f"k-{uuid.uuid4().hex}")
    results = await asyncio.gather(*(_submit(client, model, idem=idem) for _ in range(20)))
    [made] = [s for s in results if s.outcome is Outcome.queued]
    assert all(s.job_id == made.job_id for s in results)
    assert _enqueued(r, model) == (1, 1)
    assert r.get(idem) == made.job_id and r.ttl(idem) == -1  # no expiry while the job lives
    assert r.hget(keys.job(made.job_id), "idem") == idem
    # Another owner's same key is another key.
    other = await _submit(client, model, idem=keys.idempotency("owner-b", idem.rsplit(":", 1)[1]))
    assert other.outcome is Outcome.queued and other.job_id != made.job_id


async def test_an_existing_job_is_returned_even_when_the_queue_is_full(client: aioredis.Redis, r: redis.Redis):
    model, idem = _model(), keys.idempotency("", f"k-{uuid.uuid4().hex}")
    made = await _submit(client, model, cap=1, idem=idem)
    again = await _submit(client, model, cap=1, idem=idem)
    assert (again.outcome, again.job_id) == (Outcome.existing, made.job_id)


async def test_the_jobs_last_write_expires_its_idempotency_key(client: aioredis.Redis, r: redis.Redis):
    model, idem = _model(), keys.idempotency("", f"k-{uuid.uuid4().hex}")
    made = await _submit(client, model, idem=idem)
    assert worker_scripts.claim(r, made.job_id, model, "w@idem")
    pipe = r.pipeline()
    worker_scripts.update_record(pipe, "w@idem", made.job_id, model, 120, {"status": "completed"}, last=True)
    pipe.execute()
    assert 0 < r.ttl(idem) <= 120 and 0 < r.ttl(keys.job(made.job_id)) <= 120
    # Until then, the key still names the job.
    assert (await _submit(client, model, idem=idem)).job_id == made.job_id


async def test_cancel_expires_and_delete_removes_the_idempotency_key(client: aioredis.Redis, r: redis.Redis):
    model = _model()
    closing = [Event(seq=1, event=EventKind.done)]
    cancelled_idem = keys.idempotency("", f"k-{uuid.uuid4().hex}")
    cancelled = await _submit(client, model, idem=cancelled_idem)
    assert await api_scripts.cancel(client, cancelled.job_id, 60, False, closing) == "queued"
    assert 0 < r.ttl(cancelled_idem) <= 60
    # A job cancelled while it waited ended as an abort, as far as /metrics tells; a second cancel changes nothing.
    assert await api_scripts.cancel(client, cancelled.job_id, 60, False, closing) == "cancelled"
    assert metrics.read(r.hgetall(keys.metrics(model))).success == {"abort": 1}

    deleted_idem = keys.idempotency("", f"k-{uuid.uuid4().hex}")
    deleted = await _submit(client, model, idem=deleted_idem)
    assert await api_scripts.cancel(client, deleted.job_id, 60, True, closing) == "queued"
    assert not r.exists(deleted_idem)
    # A deleted job is no longer named: the same key makes a new one.
    again = await _submit(client, model, idem=deleted_idem)
    assert again.outcome is Outcome.queued and again.job_id != deleted.job_id


async def test_a_key_naming_a_job_deleted_while_running_makes_a_new_job(client: aioredis.Redis, r: redis.Redis):
    model, idem = _model(), keys.idempotency("", f"k-{uuid.uuid4().hex}")
    made = await _submit(client, model, idem=idem)
    r.hset(keys.job(made.job_id), mapping={"status": "in_progress", "worker": "w", "deleted": "1"})
    again = await _submit(client, model, idem=idem)
    assert again.outcome is Outcome.queued and again.job_id != made.job_id and r.get(idem) == again.job_id


def _listing(keep: int = 10, ttl: int = 100) -> api_scripts.Listing:
    return api_scripts.Listing(keys.owner_jobs(f"owner-{uuid.uuid4().hex[:8]}"), keep, ttl)


async def _submit_listed(client: aioredis.Redis, model: str, listing: api_scripts.Listing) -> str:
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    record = {"id": job_id, "model": model, "status": "queued"}
    queue = keys.celery_queue(model)
    done = await api_scripts.submit(client, job_id, model, record, queue, "msg", 1.0, listing=listing)
    assert done.outcome is Outcome.queued
    return job_id


async def test_an_owners_list_keeps_its_newest_jobs_in_order_and_expires(client: aioredis.Redis, r: redis.Redis):
    model, listing = _model(), _listing(keep=3, ttl=100)
    made = [await _submit_listed(client, model, listing) for _ in range(5)]
    assert r.zrange(listing.key, 0, -1) == made[2:]  # the two oldest left it
    assert 90 < r.ttl(listing.key) <= 100
    assert r.hget(keys.job(made[0]), "index") == listing.key
    # A refused submit lists nothing.
    taken = await api_scripts.submit(client, made[-1], model, {"id": made[-1]}, "q", "msg", 1.0, listing=listing)
    assert taken.outcome is Outcome.taken and r.zcard(listing.key) == 3


async def test_a_listed_jobs_end_lengthens_the_lists_expiry_and_its_delete_unlists_it(
    client: aioredis.Redis, r: redis.Redis
):
    model, listing = _model(), _listing(ttl=10)
    closing = [Event(seq=1, event=EventKind.done)]
    cancelled, ran, deleted = [await _submit_listed(client, model, listing) for _ in range(3)]
    assert await api_scripts.cancel(client, cancelled, 500, False, closing) == "queued"
    assert 490 < r.ttl(listing.key) <= 500  # as long as the cancelled job's record is kept

    assert worker_scripts.claim(r, ran, model, "w@list")
    pipe = r.pipeline()
    worker_scripts.update_record(pipe, "w@list", ran, model, 900, {"status": "completed"}, last=True)
    pipe.execute()
    assert 890 < r.ttl(listing.key) <= 900
    # A shorter expiry never shortens the list's.
    await _submit_listed(client, model, listing)
    assert r.ttl(listing.key) > 800

    assert await api_scripts.cancel(client, deleted, 60, True, closing) == "queued"
    assert r.zscore(listing.key, deleted) is None and r.zscore(listing.key, cancelled) is not None


SCRIPT_MODULES = (api_scripts, worker_scripts, reclaim_scripts)
DECLARED = {name: s for m in SCRIPT_MODULES for name, s in vars(m).items() if isinstance(s, Script)}


def _lua_words(lua: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", lua))


def test_every_declared_script_is_found():
    source = "".join(Path(m.__file__).read_text() for m in SCRIPT_MODULES)
    assert sorted(DECLARED) == sorted(re.findall(r"^(\w+) = Script\(", source, re.MULTILINE)) != []


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_a_script_reads_its_keys_and_arguments_by_their_names(name: str, r: redis.Redis):
    script = DECLARED[name]
    assert "KEYS[" not in script.body and "ARGV[" not in script.body
    assert not any("KEYS[" in f.source or "ARGV[" in f.source for f in script.uses)
    assert len(set(script.names)) == len(script.names)
    assert [n for n in script.names if n not in _lua_words(script.body)] == []
    assert r.script_load(script.source)  # it compiles


@pytest.mark.parametrize(
    ("declared", "refusal"),
    [
        (dict(keys=("job",), args=(), body="return redis.call('GET', KEYS[1])"), "reads KEYS or ARGV"),
        (dict(keys=("job",), args=("ttl",), body="return redis.call('GET', job)"), "'ttl' is declared but"),
        (dict(keys=("job",), args=("ttl",), body="-- ttl\nreturn redis.call('GET', job)"), "'ttl' is declared but"),
        (dict(keys=("job",), args=("job",), body="return job"), "'job' is named twice"),
        (dict(keys=("table",), args=(), body="return table"), "'table' hides a Lua word"),
        (dict(keys=("end",), args=(), body="return 1 end"), "'end' hides a Lua word"),
        (dict(keys=("job-log",), args=(), body="return 1"), "'job-log' is not a Lua name"),
        (dict(keys=(), args=("seq",), tail="seq", body="return seq"), "'seq' is named twice"),
        (dict(keys=(), args=(), tail="rest", body="return #ARGV"), "reads KEYS or ARGV"),
        (dict(keys=(), args=("extend",), uses=(lua.EXTEND,), body="extend(extend, 1)"), "named twice"),
        (
            dict(keys=("job",), args=(), uses=(lua.EXTEND,), body="return job"),
            "extend is in `uses` but the body never calls it",
        ),
    ],
)
def test_a_script_that_breaks_the_rules_cannot_be_declared(declared: dict, refusal: str):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        Script(**declared)


def test_a_lua_function_reading_keys_or_arguments_cannot_be_declared():
    with pytest.raises(ValueError, match="reads KEYS or ARGV"):
        LuaFunction("local function first() return KEYS[1] end")


def test_a_misnamed_argument_is_refused_before_anything_is_sent(r: redis.Redis):
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    r.hset(keys.job(job_id), mapping={"id": job_id, "status": "queued"})
    named = dict(job=keys.job(job_id), queued=keys.queued("m"), cancels=keys.cancels("w@a"))
    named |= dict(
        running=keys.running("m"),
        dispatched=keys.dispatched("m"),
        worker="w@a",
        now=1.0,
        job_id=job_id,
        lane=0,
        delivery="",
    )
    with pytest.raises(TypeError, match=r"without \['delivery'\], with undeclared \['deliver'\]"):
        worker_scripts._CLAIM.run(r, **{k: v for k, v in named.items() if k != "delivery"}, deliver="")
    with pytest.raises(TypeError, match=r"without \['lane'\]"):
        worker_scripts._CLAIM.run(r, **{k: v for k, v in named.items() if k != "lane"})
    assert r.hget(keys.job(job_id), "status") == "queued"
    # Named in any order, the arguments reach their places.
    assert worker_scripts._CLAIM.run(r, **dict(reversed(named.items())))
    assert r.hmget(keys.job(job_id), "status", "worker") == ["in_progress", "w@a"]


def test_a_script_redis_no_longer_holds_is_loaded_again(r: redis.Redis):
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    r.hset(keys.job(job_id), mapping={"id": job_id, "status": "queued"})
    r.script_flush()  # as a restarted Redis has none
    assert worker_scripts.claim(r, job_id, "m", "w@a")["status"] == "in_progress"


# The one place Lua writes an event's envelope, run on its own.
_WRITE_ENVELOPE = Script(
    keys=(), args=("seq", "kind", "data"), uses=(reclaim_scripts._ENVELOPE,), body="return envelope(seq, kind, data)"
)


@pytest.mark.parametrize(
    "event",
    [
        Event(7, EventKind.error, {"error": {"message": 'a "quoted" é ☃\nline', "code": 500, "param": None}}),
        Event(8, EventKind.done),
        Event(1, EventKind.chunk, {"choices": [{"index": 0, "delta": {"content": "hi"}}]}),
    ],
)
def test_the_lua_event_envelope_reads_back_as_its_event(event: Event, r: redis.Redis):
    written = _WRITE_ENVELOPE.run(r, seq=event.seq, kind=event.event.value, data=orjson.dumps(event.data))
    assert Event.from_json(written) == event
