"""Waiting for a replica to have a write: a worker's step is on the replica when its flush returns, and a replica
that stops answering costs one wait, logged, then none for a while; the steps land on the master all along."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from chatq.core import keys
from chatq.core.job import Event, EventKind
from chatq.core.replicas import ReplicaWait
from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port, redis_server_binary
from chatq.worker.publish import Publisher, StepWrites


@contextlib.contextmanager
def master_and_replica(tmp: Path) -> Iterator[tuple[EmbeddedRedis, subprocess.Popen, redis.Redis]]:
    master = EmbeddedRedis(tmp / "master", persist=False).start()
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp)]
    command = [redis_server_binary(), *args, "--replicaof", "127.0.0.1", str(master.port)]
    replica = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    reader = redis.Redis(port=port, decode_responses=True)
    try:
        deadline = time.monotonic() + 30
        while not _linked(reader):
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.05)
        yield master, replica, reader
    finally:
        replica.send_signal(signal.SIGCONT)
        replica.terminate()
        replica.wait(timeout=10)
        master.stop()


def _linked(reader: redis.Redis) -> bool:
    with contextlib.suppress(redis.ConnectionError):
        return reader.info("replication").get("master_link_status") == "up"
    return False


def step(job_id: str, seq: int) -> StepWrites:
    return StepWrites(events=[(job_id, Event(seq=seq, event=EventKind.chunk, data={"n": seq}))])


def test_a_step_is_on_the_replica_once_written_and_a_silent_replica_is_waited_for_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with master_and_replica(tmp_path) as (master, replica, reader):
        settings = Settings(redis_url=master.url, redis_wait_replicas=1, redis_wait_timeout=0.2)
        client = redis.Redis.from_url(master.url, decode_responses=True)
        job_id = "chatcmpl-replicated"
        client.hset(keys.job(job_id), mapping={"id": job_id, "status": "in_progress", "worker": "w"})
        publisher = Publisher(client, settings, "w")
        assert publisher.redis is not client  # a connection of its own, which WAIT follows

        publisher.flush(step(job_id, 1))
        assert len(reader.xrange(keys.events(job_id))) == 1  # read at once from the replica: WAIT saw it there

        replica.send_signal(signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="chatq.core.replicas"):
            for seq in (2, 3, 4):
                publisher.flush(step(job_id, seq))
        assert [r.getMessage() for r in caplog.records] == [
            "0 of 1 Redis replicas took a write within 0.20 s; not waiting for them for 10 s"
        ]
        assert len(client.xrange(keys.events(job_id))) == 4  # every step landed on the master


def test_no_replicas_are_waited_for_unless_asked() -> None:
    assert ReplicaWait(0, 1.0).command() is None
    assert ReplicaWait(2, 0.25).command() == ("WAIT", 2, 250)
