"""The key layout: docs/redis.md shows it as keys.py declares it, and every name a builder makes has its row."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from chatq.core import keys

ROOT = Path(__file__).resolve().parent.parent.parent

# Arguments to call each builder with: a builder added to keys.py needs its example here, and then its row.
EXAMPLES = {
    keys.job: ("abc",),
    keys.events: ("abc",),
    keys.live: ("abc",),
    keys.cancels: ("w1",),
    keys.queued: ("m",),
    keys.models: (),
    keys.model: ("m",),
    keys.adapters: (),
    keys.workers: ("m",),
    keys.worker: ("m@host-7#1a2b3c4d",),
    keys.running: ("m",),
    keys.metrics: ("m",),
    keys.idempotency: ("0f", "key"),
    keys.owner_jobs: ("0f",),
    keys.file: ("file-abc",),
    keys.owner_files: ("0f",),
    keys.files_due: (),
    keys.batch: ("batch_abc",),
    keys.owner_batches: ("0f",),
    keys.batch_statuses: (),
    keys.batch_results: ("batch_abc",),
    keys.batch_released: ("batch_abc",),
    keys.batch_lines: ("m",),
    keys.batches_running: (),
    keys.batch_line_counts: (),
    keys.batch_runner: ("batch_abc",),
    keys.api_key: ("0f",),
    keys.api_key_names: (),
    keys.rate_bucket: ("0f", "tokens"),
    keys.in_flight: ("0f",),
    keys.usage: ("2026-12-05", "0f"),
    keys.batch_tokens: ("0f",),
    keys.dispatched: ("m",),
    keys.fair_waiting: ("m", 5),
    keys.fair_parked: ("m", 5, "0f"),
    keys.fair_service: ("m",),
    keys.fair_clock: ("m",),
    keys.celery_queue: ("m",),
    keys.celery_lane: (keys.celery_queue("m"), 3),
    keys.webhook_queue: (),
    keys.webhook_unacked: ("unacked_mutex",),
}


def test_the_redis_page_shows_the_layout_keys_py_declares():
    page = (ROOT / "docs" / "redis.md").read_text()
    assert keys.layout_table() in page, "regenerate docs/redis.md's table: python -m chatq.core.keys"


def test_every_name_a_builder_makes_has_its_row():
    builders = {f for name, f in vars(keys).items() if inspect.isfunction(f) and f.__module__ == keys.__name__}
    assert builders - {keys.layout_table} == set(EXAMPLES)
    # A row's {placeholder} stands for any part of a name between colons.
    rows = [re.compile(re.sub(r"\\\{\w+\\\}", "[^:]+", re.escape(n))) for e in keys.LAYOUT for n in e.names]
    made = [build(*args) for build, args in EXAMPLES.items()] + [keys.KOMBU_UNACKED, keys.KOMBU_UNACKED_INDEX]
    assert [name for name in made if not any(row.fullmatch(name) for row in rows)] == []
