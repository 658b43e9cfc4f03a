"""The task message the API's submit script enqueues is the one Celery's send_task would have published."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import redis
from flower.utils.broker import Broker

from chatq.core import keys
from chatq.core.broker import RedisTransport
from chatq.core.queue import BATCH_LANE, GENERATE_TASK, PRIORITY_LANES, celery_priority, make_celery, task_message
from chatq.core.settings import Settings

RANDOM = {"id", "root_id", "correlation_id", "delivery_tag", "origin", "reply_to", "argsrepr"}


def _shape(raw: str) -> dict:
    """The message with its per-send ids blanked and its body decoded."""
    msg = json.loads(raw)
    msg["body"] = json.loads(base64.b64decode(msg["body"]))
    for part in (msg["headers"], msg["properties"]):
        for k in RANDOM & part.keys():
            part[k] = "*"
    return msg


@pytest.mark.parametrize("lane", [0, 4, 9, BATCH_LANE])
def test_matches_send_task(settings: Settings, r: redis.Redis, lane: int) -> None:
    app = make_celery(settings)
    queue = f"chatq.test-envelope-{lane}"
    app.send_task(GENERATE_TASK, args=["job-1"], queue=queue, priority=lane)
    [sent_key] = [k for k in r.scan_iter(f"{queue}*") if not k.startswith("_kombu")]
    sent = r.rpop(sent_key)

    key, ours = task_message(app, "job-1", queue, lane)

    assert key == sent_key
    assert _shape(ours) == _shape(sent)
    assert _shape(ours)["body"][0] == ["job-1"]
    assert json.loads(ours)["headers"]["argsrepr"] == "['job-1']"


@pytest.mark.parametrize("lane", [6, BATCH_LANE])
def test_flower_reads_the_length_of_a_models_queue(settings: Settings, r: redis.Redis, lane: int) -> None:
    # As Flower's broker page builds its view of the broker: from the app's connection URI and transport options.
    app = make_celery(settings.model_copy(update={"model_name": "test-flower-queue"}))
    queue = keys.celery_queue("test-flower-queue")
    with app.connection() as conn:
        assert isinstance(conn.transport, RedisTransport)  # the workers' transport, under redis:// itself
        uri = conn.as_uri(include_password=True)
    broker = Broker(uri, broker_options=app.conf.broker_transport_options)
    lane_queue, message = task_message(app, "chatcmpl-flower", queue, lane)
    r.lpush(lane_queue, message)
    try:
        assert asyncio.run(broker.queues([queue])) == [{"name": queue, "messages": 1}]
    finally:
        r.delete(lane_queue)


def test_interactive_lanes_come_before_background_ones() -> None:
    interactive = [celery_priority(p) for p in range(-10, 11)]
    background = [celery_priority(p, background=True) for p in range(-10, 11)]
    assert max(interactive) < min(background)
    assert set(interactive) == {0, 1, 2, 3, 4} and set(background) == {5, 6, 7, 8, 9}
    # Within each half, a lower priority value goes first; the default sits in the middle, with room both ways.
    assert interactive == sorted(interactive) and background == sorted(background)
    assert celery_priority(0) == 2 and celery_priority(0, background=True) == 7
    assert celery_priority(-1) < celery_priority(0) < celery_priority(1)


def test_a_batch_line_comes_after_every_other_lane_and_keeps_its_lane_when_put_back(settings: Settings) -> None:
    every = {celery_priority(p, background) for p in range(-10, 11) for background in (False, True)}
    assert BATCH_LANE == PRIORITY_LANES - 1 > max(every)
    with make_celery(settings).connection() as conn:
        channel = conn.default_channel
        # What kombu reads when it puts back a lost worker's message: 9 at most, were chatq's channel kombu's own.
        message = {"properties": {"priority": BATCH_LANE}}
        assert channel._get_message_priority(message, reverse=False) == BATCH_LANE
        assert BATCH_LANE in channel.priority_steps
