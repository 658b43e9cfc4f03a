"""The Celery application both sides share: the API builds task messages with it, workers register and run them."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import orjson
from celery import Celery
from kombu.transport import TRANSPORT_ALIASES

from chatq.core import keys
from chatq.core.redis_url import broker, broker_use_ssl
from chatq.core.settings import Settings

GENERATE_TASK = "chatq.generate"
REDIS_TRANSPORT = "chatq.core.broker:RedisTransport"
SENTINEL_TRANSPORT = "chatq.core.broker:SentinelTransport"

# Redis' lanes, 0 served first: interactive requests (a client holds a connection open) take the first five,
# background jobs the next five, and a batch's lines the last, so any waiting interactive job is picked before every
# background one, and both before any batch line.
LANES_PER_KIND = 5
BATCH_LANE = 2 * LANES_PER_KIND
PRIORITY_LANES = BATCH_LANE + 1


def celery_priority(priority: int, background: bool = False) -> int:
    """A request's priority (lower goes first, 0 by default, as in vLLM) -> one of the interactive or background
    lanes.

    Within its kind's lanes, the default sits in the middle one, so both more and less urgent requests have room;
    the extremes share the end lanes.
    """
    lane = min(max(priority + LANES_PER_KIND // 2, 0), LANES_PER_KIND - 1)
    return lane + LANES_PER_KIND if background else lane


def lane_score(lane: int, now: float) -> float:
    """A queued job's score in keys.queued: by lane, then arrival, so a rank there is its place in the pick order."""
    return lane * 1e11 + now


def make_celery(settings: Settings) -> Celery:
    # chatq's transport takes over the redis:// schemes rather than being set as `broker_transport`: Flower reads
    # queue lengths only for schemes it knows. Loaded on connecting, so never by the API.
    TRANSPORT_ALIASES.update(redis=REDIS_TRANSPORT, rediss=REDIS_TRANSPORT, sentinel=SENTINEL_TRANSPORT)
    # A Sentinel URL becomes kombu's form of it, its master's name a transport option (Flower reads both).
    url, sentinel_options = broker(settings.redis_url)
    app = Celery("chatq", broker=url, set_as_current=False)
    app.conf.update(
        # rediss://: kombu and Flower take TLS options only from here, not from the URL's query.
        broker_use_ssl=broker_use_ssl(settings.redis_url),
        # Job state lives in chatq's own job record; Celery's results would only duplicate it.
        task_ignore_result=True,
        result_backend=None,
        # A job is acknowledged only once it finished, so a worker that dies mid-job leaves it to be redelivered.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # A job goes on through a broker outage: its engine keeps it, and its writes wait for Redis. (Cancelled, it
        # would be delivered again only to find itself claimed.)
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # Redelivery of an unacknowledged job waits this long; it must outlast the longest generation.
        # Each priority has its own list, polled in order, so an urgent job overtakes queued others.
        broker_transport_options={
            "visibility_timeout": 3 * 3600,
            "queue_order_strategy": "priority",
            "priority_steps": list(range(PRIORITY_LANES)),
            **sentinel_options,
        },
        task_default_priority=celery_priority(0),
        task_serializer="json",
        accept_content=["json"],
        # No task events unless someone watches: publishing three per job is costly for a worker. Flower switches
        # them on (its periodic enable_events broadcast).
        worker_send_task_events=False,
        task_default_queue=keys.celery_queue(settings.model_name),
        worker_hijack_root_logger=False,
    )
    return app


def task_message(app: Celery, job_id: str, queue: str, lane: int) -> tuple[str, str]:
    """The Redis list and the message that `app.send_task(GENERATE_TASK, [job_id], queue=queue, priority=lane)`
    would push there, for the API's submit script to push itself.

    send_task would publish over its own blocking connection, a second round trip after the job record: costly,
    and an API dying in between would strand a queued job. Celery builds the task message (protocol 2); only
    kombu's Redis envelope is written here, as its basic_publish does.
    """
    task_id = str(uuid.uuid4())
    # The reprs are given, sparing Celery's slow saferepr of them.
    msg = app.amqp.as_task_v2(
        task_id, GENERATE_TASK, args=[job_id], ignore_result=None, argsrepr=repr([job_id]), kwargsrepr="{}"
    )
    envelope = redis_envelope(msg, queue, lane, base64_body=True)
    return keys.celery_lane(queue, lane), orjson.dumps(envelope).decode()


def redis_envelope(msg: Any, queue: str, priority: int, *, base64_body: bool) -> dict[str, Any]:
    """kombu's Redis envelope around a Celery task message, as its basic_publish writes it."""
    body = orjson.dumps(msg.body)
    properties = msg.properties | {
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": priority,
        "delivery_tag": str(uuid.uuid4()),
    }
    if base64_body:
        properties["body_encoding"] = "base64"
    return {
        "body": base64.b64encode(body).decode() if base64_body else body.decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": msg.headers,
        "properties": properties,
    }


def task_fields(queue: str, message: str, now: float) -> dict[str, str]:
    """What a queued job's record says of its task message, so a message lost on its way to a worker (one popped by
    a worker that died before taking it) is found missing and sent again (chatq.core.reclaim_scripts.redeliver)."""
    properties = orjson.loads(message)["properties"]
    return {
        "task_queue": queue,
        "task": message,
        "tag": properties["delivery_tag"],
        "lane": str(properties["priority"]),
        "queued_at": repr(now),
    }
