"""Every Redis key, channel and Celery queue name chatq uses, built in one place.

Layout (documented in docs/redis.md):
  chatq:job:{id}            hash   the job record (status, request, result, progress)
  chatq:job:{id}:events     stream the replayable event log, entry ids 0-{seq}
  chatq:job:{id}:live       pubsub the same events as they happen
  chatq:cancels:{worker}    set    ids of that worker's running jobs that a client cancelled; read at every step
  chatq:queue:{model}       zset   jobs waiting for a worker of that model, for queue positions
  chatq:models              set    names of the models a worker registered (live or not)
  chatq:model:{model}       hash   what the API needs to serve that model: its card, tokenizer and chat templates
  chatq:workers:{model}     zset   live workers of that model, scored by last heartbeat
  chatq:running:{model}     set    ids of that model's jobs a worker holds, for the sweep that reclaims a dead one's
  chatq:idem:{owner}:{key}  string the job id an Idempotency-Key names, for that owner (a hash of the API key)
  chatq:owner:{owner}:jobs  zset   that owner's newest job ids, scored by submit time, for the jobs list
  chatq:metrics:{model}     hash   finished jobs' metrics: histogram bucket counters, sums, token and finish counts
  chatq.{model}             list   Celery's queue of that model's tasks, one list per priority lane (celery_lane)
  unacked, unacked_index    hash, zset  kombu's delivered, unacknowledged messages (a reclaimed job's are dropped)
  chatq.webhooks            list   Celery's queue of webhook deliveries, pushed by a job's last write
  chatq:webhooks:unacked, chatq:webhooks:unacked_index, chatq:webhooks:unacked_mutex  the same for the webhook worker
"""

from __future__ import annotations

PREFIX = "chatq"


def job(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def events(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:events"


def live(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:live"


def cancels(worker: str) -> str:
    """The cancel requests for one worker's running jobs. The cancel script finds the holding worker in the job's
    record and completes `cancels("")` with its name."""
    return f"{PREFIX}:cancels:{worker}"


def waiting(model: str) -> str:
    return f"{PREFIX}:queue:{model}"


def models() -> str:
    return f"{PREFIX}:models"


def model(name: str) -> str:
    return f"{PREFIX}:model:{name}"


def workers(model: str) -> str:
    return f"{PREFIX}:workers:{model}"


def running(model: str) -> str:
    return f"{PREFIX}:running:{model}"


def metrics(model: str) -> str:
    return f"{PREFIX}:metrics:{model}"


def idempotency(owner: str, key: str) -> str:
    """The job an Idempotency-Key names. `owner` is a hex hash (or empty for an open API), so the key's own colons
    cannot make two owners' names meet."""
    return f"{PREFIX}:idem:{owner}:{key}"


def owner_jobs(owner: str) -> str:
    """The ids of the jobs an owner submitted, newest kept, for GET /v1/chat/completions."""
    return f"{PREFIX}:owner:{owner}:jobs"


def celery_queue(model: str) -> str:
    return f"{PREFIX}.{model}"


def webhook_queue() -> str:
    return f"{PREFIX}.webhooks"


def webhook_unacked(name: str) -> str:
    """kombu's bookkeeping of the webhook worker's unacknowledged deliveries ("unacked", "unacked_index",
    "unacked_mutex"), apart from the generation workers': its short visibility timeout must not redeliver their jobs."""
    return f"{PREFIX}:webhooks:{name}"


# kombu's Redis transport keeps each delivered, unacknowledged message here (by delivery tag) until its ack.
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"

# kombu's Redis transport keeps priority lane n of queue q in the list "q\x06\x16n", lane 0 in "q" itself.
_LANE_SEP = "\x06\x16"


def celery_lane(queue: str, lane: int) -> str:
    return f"{queue}{_LANE_SEP}{lane}" if lane else queue
