"""Every Redis key, channel and Celery queue name chatq uses, built in one place.

LAYOUT, at the end, gives each name's type and content: docs/redis.md's table is generated from it
(`python -m chatq.core.keys` prints the table).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def queued(model: str) -> str:
    """The model's queued jobs, ranked in the order its workers take them."""
    return f"{PREFIX}:queue:{model}"


def models() -> str:
    return f"{PREFIX}:models"


def model(name: str) -> str:
    return f"{PREFIX}:model:{name}"


def workers(model: str) -> str:
    return f"{PREFIX}:workers:{model}"


def worker(name: str) -> str:
    """A live worker's own entry: its model, device and how its engine runs."""
    return f"{PREFIX}:worker:{name}"


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


def file(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}"


def owner_files(owner: str) -> str:
    """The ids of an owner's files, for GET /v1/files."""
    return f"{PREFIX}:owner:{owner}:files"


def batch(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}"


def owner_batches(owner: str) -> str:
    """The ids of an owner's batches, for GET /v1/batches."""
    return f"{PREFIX}:owner:{owner}:batches"


def batch_statuses() -> str:
    """How many batches are in each status, for /metrics."""
    return f"{PREFIX}:batches:statuses"


def batch_results(batch_id: str) -> str:
    """A running batch's answered lines, by line number: each line of its output or error file, written once."""
    return f"{PREFIX}:batch:{batch_id}:results"


def batch_released(batch_id: str) -> str:
    """A running batch's lines released into the queue and not yet answered, by line number."""
    return f"{PREFIX}:batch:{batch_id}:released"


def batch_lines(model: str) -> str:
    """Every batch's lines released for a model and not yet answered: what bounds the lines in its queue."""
    return f"{PREFIX}:batch-lines:{model}"


def batch_line_counts() -> str:
    """How many batch lines were answered, by outcome, for /metrics."""
    return f"{PREFIX}:batches:lines"


def batches_running() -> str:
    """The batches an API has work for: checking, releasing, answering and ending their lines."""
    return f"{PREFIX}:batches:running"


def batch_runner(batch_id: str) -> str:
    """The API process running a batch, while its lease lasts."""
    return f"{PREFIX}:batch:{batch_id}:runner"


def files_due() -> str:
    """Files whose bytes are to leave the store, each at its score: those that expire, those deleted, and uploads not
    yet recorded, at the end of their lease."""
    return f"{PREFIX}:files:due"


def api_key(key_hash: str) -> str:
    """A managed API key's record (chatq.core.api_keys), by the SHA-256 of its secret."""
    return f"{PREFIX}:apikey:{key_hash}"


def api_key_names() -> str:
    return f"{PREFIX}:apikeys"


def in_flight(owner: str) -> str:
    """A managed key's jobs queued or running, when it has a cap on them."""
    return f"{PREFIX}:inflight:{owner}"


def rate_bucket(owner: str, kind: str) -> str:
    """A managed key's bucket of `requests` or `tokens` per minute (chatq.core.rate_limits)."""
    return f"{PREFIX}:rate:{owner}:{kind}"


def usage(day: str, owner: str) -> str:
    """An API key's usage on one day (chatq.core.usage), by the hash of the key."""
    return f"{PREFIX}:usage:{day}:{owner}"


def batch_tokens(owner: str) -> str:
    """An API key's input tokens held by its batches in progress, by model (chatq.core.batches)."""
    return f"{PREFIX}:batchtokens:{owner}"


def dispatched(model: str) -> str:
    """The model's jobs whose task message went to a Celery lane, not yet claimed by a worker (chatq.core.fair)."""
    return f"{PREFIX}:dispatched:{model}"


def fair_waiting(model: str, lane: int | str) -> str:
    """The owners with jobs parked in one of the model's lanes, scored by their service."""
    return f"{PREFIX}:fair:{model}:waiting:{lane}"


def fair_parked(model: str, lane: int | str, owner: str) -> str:
    """One owner's jobs parked in one of the model's lanes, oldest first."""
    return f"{PREFIX}:fair:{model}:parked:{lane}:{owner}"


def fair_clock(model: str) -> str:
    """The model's virtual time: the service at which its last dispatched job started (chatq.core.fair)."""
    return f"{PREFIX}:fair:{model}:clock"


def fair_service(model: str) -> str:
    """Each owner's service from the model's workers: weighted tokens (chatq.core.fair)."""
    return f"{PREFIX}:fair:{model}:service"


def adapters() -> str:
    """The known LoRA adapters, by name: each one's record (chatq.core.adapters)."""
    return f"{PREFIX}:adapters"


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


@dataclass(frozen=True)
class Entry:
    """One row of the layout: names of one kind, their Redis type, and what they hold (Markdown)."""

    names: tuple[str, ...]
    type: str
    content: str


LAYOUT = (
    Entry((job("{id}"),), "hash", "the job record (fields below)"),
    Entry((events("{id}"),), "stream", "every event of the job; entry id `0-{seq}`, one field `msg`"),
    Entry((live("{id}"),), "pub/sub", "the same `msg` of each event as it happens"),
    Entry((cancels("{worker}"),), "set", "ids of that worker's running jobs that a client cancelled"),
    Entry(
        (queued("{model}"),),
        "zset",
        "that model's queued job ids, ranked in the order its workers take them: queue positions",
    ),
    Entry((models(),), "set", "names of the models a worker registered, live or not"),
    Entry(
        (model("{model}"),),
        "hash",
        "the model's entry: `record` (JSON: `name`, `max_model_len`, `vocab_size`, `chat_templates`, "
        "`special_tokens`, `eos_token_ids`, `sampling_defaults`, `lora`: what adapters its workers take), "
        "`tokenizer` (its `tokenizer.json`), `digest` (of the two), `created`",
    ),
    Entry(
        (adapters(),),
        "hash",
        "the known LoRA adapters: name -> JSON record (`name`, `base`, `path`, `rank`, `id` of this load, `created`)",
    ),
    Entry((workers("{model}"),), "zset", "live workers, scored by their last heartbeat"),
    Entry(
        (worker("{worker}"),),
        "hash",
        "a live worker's entry, written by each heartbeat and gone a worker TTL after its last: `model`, `device`, "
        "`mode` (how its engine's decode steps run: [GPU workers](gpu.md#the-start-check)), `checks` (JSON: its "
        "start check, one line a check)",
    ),
    Entry(
        (running("{model}"),),
        "set",
        "ids of the model's jobs a worker holds: what the sweep checks against the live workers",
    ),
    Entry((idempotency("{owner}", "{key}"),), "string", "the job id an `Idempotency-Key` names for that owner"),
    Entry(
        (owner_jobs("{owner}"),),
        "zset",
        "that owner's newest 1000 job ids, scored by submit time: `GET /v1/chat/completions`",
    ),
    Entry(
        (file("{id}"),),
        "hash",
        "a file's record (`chatq/core/files.py`): `id`, `owner`, `bytes`, `lines`, `created_at`, `filename`, "
        "`purpose`, `expires_at`; its bytes are in the file store ([files](batches.md#files))",
    ),
    Entry((owner_files("{owner}"),), "zset", "that owner's file ids, scored by upload time: `GET /v1/files`"),
    Entry(
        (files_due(),),
        "zset",
        "file ids whose bytes are to be deleted from the store at their score: an expiry, `0` for a file deleted or "
        "being reaped, an unfinished upload's lease; the API's sweep deletes them",
    ),
    Entry(
        (batch("{id}"),),
        "hash",
        "a batch's record (`chatq/core/batches.py`): `id`, `owner`, `endpoint`, `input_file_id`, "
        "`completion_window`, `status`, `created_at`, `expires_at`, one `{status}_at` per status reached, `model`, "
        "`output_file_id`, `error_file_id`, and as JSON `metadata`, `errors`, `counts`, `usage`",
    ),
    Entry((owner_batches("{owner}"),), "zset", "that owner's batch ids, scored by creation time: `GET /v1/batches`"),
    Entry(
        (batch_results("{id}"),),
        "hash",
        "a running batch's answered lines: line number -> `{kind, line, usage}` (`kind` `output` or `error`, `line` "
        "the output or error file's line); written once per line, deleted when the batch ends",
    ),
    Entry(
        (batch_released("{id}"),),
        "zset",
        "a running batch's lines in the queue: line numbers, scored by release time",
    ),
    Entry(
        (batch_lines("{model}"),),
        "zset",
        "every batch's lines in that model's queue: `{batch id}:{line}`, scored by release time; its size bounds "
        "what the runners release ([batches](batches.md#how-a-batch-runs))",
    ),
    Entry((batches_running(),), "zset", "batches an API runs, scored by when they started"),
    Entry(
        (batch_line_counts(),),
        "hash",
        "batch lines answered since Redis began, by outcome (`completed`, `failed`): read by `/metrics`",
    ),
    Entry((batch_runner("{id}"),), "string", "the API process running that batch; expires unless renewed"),
    Entry(
        (batch_statuses(),),
        "hash",
        "how many batches are in each status (`validating`, `in_progress`, ...), kept by the script that moves "
        "them; read by `/metrics`",
    ),
    Entry(
        (api_key("{hash}"),),
        "string",
        "a managed API key's record, by the SHA-256 of its secret (JSON: `name`, `hash`, `redacted`, `created_at`, "
        "`expires_at`, `limits`) ([keys](keys.md))",
    ),
    Entry((api_key_names(),), "hash", "each managed API key's name -> the hash of its secret"),
    Entry(
        (in_flight("{hash}"),),
        "zset",
        "a managed key's job ids queued or running, scored by submit, kept when it has an `in_flight` cap; each submit "
        "drops those whose record ended",
    ),
    Entry(
        (rate_bucket("{hash}", "requests"), rate_bucket("{hash}", "tokens")),
        "hash",
        "a managed key's requests and tokens left this minute: `level`, `at` (when it was that); expires once full "
        "([keys](keys.md#limits))",
    ),
    Entry(
        (usage("{day}", "{hash}"), usage("total", "{hash}")),
        "hash",
        "an API key's usage that day (UTC), kept 90 days, and since it began: `{model}|requests`, "
        "`{model}|input_tokens`, `{model}|output_tokens` ([keys](keys.md#usage))",
    ),
    Entry(
        (batch_tokens("{hash}"),),
        "hash",
        "a managed key's input tokens held by its batches in progress: `{model}` -> tokens, checked against its "
        "`batch_tokens` limit ([keys](keys.md#limits))",
    ),
    Entry(
        (dispatched("{model}"),),
        "set",
        "that model's job ids whose task message went to a Celery lane, not yet claimed "
        "([fair share](keys.md#fair-share))",
    ),
    Entry(
        (fair_waiting("{model}", "{lane}"),),
        "zset",
        "the owners (API key hashes) with jobs parked in that lane, scored by their service",
    ),
    Entry(
        (fair_parked("{model}", "{lane}", "{hash}"),), "list", "one owner's job ids parked in that lane, oldest first"
    ),
    Entry((fair_service("{model}"),), "hash", "each owner's service from that model's workers: weighted tokens"),
    Entry(
        (fair_clock("{model}"),), "string", "that model's virtual time: the service its last dispatched job began at"
    ),
    Entry(
        (metrics("{model}"),),
        "hash",
        "finished jobs' metrics, read by `/metrics`: per-bucket histogram counters, sums, counts, token totals, "
        "`success:{finished_reason}` ([metrics](observing.md#metrics))",
    ),
    Entry(
        (celery_queue("{model}"), celery_queue("{model}") + _LANE_SEP + "{lane}"),
        "list",
        "the Celery queue of that model, one list per priority lane",
    ),
    Entry(
        (KOMBU_UNACKED, KOMBU_UNACKED_INDEX),
        "hash, zset",
        "kombu's delivered, unacknowledged messages of the models' queues, by delivery tag (a reclaimed job's are "
        "dropped)",
    ),
    Entry(
        (webhook_queue(),),
        "list",
        "the Celery queue of webhook deliveries, pushed by the script that ends a background job "
        "([webhooks](webhooks.md))",
    ),
    Entry(
        tuple(webhook_unacked(name) for name in ("unacked", "unacked_index", "unacked_mutex")),
        "hash, zset, string",
        "kombu's bookkeeping of the webhook worker's unacknowledged deliveries, apart from the generation workers' "
        "`unacked`",
    ),
)


def layout_table() -> str:
    """LAYOUT as docs/redis.md's Markdown table."""
    rows = ["| key | type | content |", "|---|---|---|"]
    for entry in LAYOUT:
        names = ", ".join(f"`{name.encode('unicode_escape').decode()}`" for name in entry.names)
        rows.append(f"| {names} | {entry.type} | {entry.content} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(layout_table(), end="")
