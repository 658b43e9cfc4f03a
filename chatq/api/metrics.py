"""GET /metrics: Prometheus' view of the service, named after vLLM's metrics (`chatq:` prefix, label `model_name`).

Per model, read from Redis at each scrape, so every API replica reports the same numbers: the queue and running
gauges, and the finished jobs' histograms and counters that workers add in each job's last write
(chatq.core.metrics). Per process: the HTTP requests this replica answered, by route and status.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatq.core import api_keys, keys, usage
from chatq.core import metrics as m
from chatq.core.batches import STATUSES

LABELS = ["model_name"]
UNMATCHED = "unmatched"  # the route label of a path no route has: the paths themselves would be unbounded
# Methods by name; any other a client makes up is "other", for the same reason.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

router = APIRouter()


class HTTPMetrics:
    """ASGI middleware counting every HTTP request by method, route template and status, errors included (those
    the error handlers answer, and 500s for what they do not). Pure ASGI, so streamed responses pass untouched."""

    def __init__(self, app: ASGIApp, requests: Counter):
        self.app = app
        self.requests = requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                self._count(scope, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not status:  # the server answers 500 for it
                self._count(scope, 500)
            raise

    def _count(self, scope: Scope, status: int) -> None:
        method = scope["method"] if scope["method"] in METHODS else "other"
        route = getattr(scope.get("route"), "path", UNMATCHED)
        self.requests.labels(method, route, str(status)).inc()


def http_counter(registry: CollectorRegistry) -> Counter:
    # No `_created` series beside each counter: Prometheus' text format reads them as series of their own.
    disable_created_metrics()
    return Counter(
        m.PREFIX + "http_requests",
        "HTTP requests this API process answered, by method, route and status.",
        ["method", "route", "status"],
        registry=registry,
    )


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    service = request.app.state.service
    families = await read_models(service.redis, service.settings.model_name) + await read_batches(service.redis)
    families += await read_keys(service.redis)
    scrape = _Scrape([request.app.state.metrics_registry, families])
    return Response(generate_latest(scrape), media_type=CONTENT_TYPE_LATEST)


async def read_models(client: aioredis.Redis, default_model: str) -> list[Metric]:
    """Every registered model's queue, running jobs and finished jobs' metrics, as metric families."""
    registered: set[str] = await client.smembers(keys.models())  # type: ignore[assignment,misc]  # a decoding client
    models = sorted(registered | {default_model})
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.zcard(keys.queued(model))
        pipe.scard(keys.running(model))
        pipe.hgetall(keys.metrics(model))
        pipe.zcard(keys.batch_lines(model))
    replies: list[Any] = await pipe.execute()
    readings = [(model, *replies[4 * i : 4 * i + 3]) for i, model in enumerate(models)]
    released = GaugeMetricFamily(
        m.PREFIX + "batch_lines_released", "Batch lines in the model's queue or running.", labels=LABELS
    )
    for i, model in enumerate(models):
        released.add_metric([model], replies[4 * i + 3])
    return [*_gauges(readings), *_finished(readings), released]


async def read_batches(client: aioredis.Redis) -> list[Metric]:
    """How many batches are in each status, and their lines: answered by outcome, and in the queue."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.batch_statuses())
    pipe.hgetall(keys.batch_line_counts())
    counts, lines = await pipe.execute()
    gauge = GaugeMetricFamily(m.PREFIX + "batches", "Batches in each status.", labels=["status"])
    for status in STATUSES:
        gauge.add_metric([status], max(0, int(counts.get(status) or 0)))
    answered = CounterMetricFamily(
        m.PREFIX + "batch_lines", "Batch lines answered, by the request_counts field they add to.", labels=["status"]
    )
    for status in ("completed", "failed"):
        answered.add_metric([status], int(lines.get(status) or 0))
    return [gauge, answered]


async def read_keys(client: aioredis.Redis) -> list[Metric]:
    """Each managed key's usage since it began, labelled by the key's name: only managed keys have names, and only
    an admin makes them, so the labels stay few."""
    named = await api_keys.listing(client)
    spent = await usage.totals(client, [k.hash for k in named])
    families: list[Metric] = []
    for measure, doc in (
        ("requests", "Requests of each managed API key, by model."),
        ("input_tokens", "Prompt tokens of each managed API key's requests, by model."),
        ("output_tokens", "Output tokens of each managed API key's requests, by model."),
    ):
        counter = CounterMetricFamily(m.PREFIX + f"api_key_{measure}", doc, labels=["api_key", *LABELS])
        for key, by_model in zip(named, spent, strict=True):
            for model, amounts in sorted(by_model.items()):
                counter.add_metric([key.name, model], amounts[measure])
        families.append(counter)
    return families


def _gauges(readings: list[tuple[str, int, int, dict[str, str]]]) -> Iterator[Metric]:
    waiting = GaugeMetricFamily(
        m.PREFIX + "num_requests_waiting", "Requests queued for a worker of the model.", labels=LABELS
    )
    running = GaugeMetricFamily(m.PREFIX + "num_requests_running", "Requests a worker is running.", labels=LABELS)
    for model, queued, held, _ in readings:
        waiting.add_metric([model], queued)
        running.add_metric([model], held)
    yield from (waiting, running)


def _finished(readings: list[tuple[str, int, int, dict[str, str]]]) -> Iterator[Metric]:
    hists = {h.name: HistogramMetricFamily(m.PREFIX + h.name, h.help, labels=LABELS) for h in m.HISTOGRAMS}
    prompt = CounterMetricFamily(m.PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", labels=LABELS)
    generation = CounterMetricFamily(
        m.PREFIX + "generation_tokens", "Tokens generated for finished requests.", labels=LABELS
    )
    success = CounterMetricFamily(
        m.PREFIX + "request_success",
        "Requests that ended on a worker, by how they finished.",
        labels=[*LABELS, "finished_reason"],
    )
    for model, _, _, fields in readings:
        reading = m.read(fields)
        for name, family in hists.items():
            family.add_metric([model], reading.histograms[name].buckets, reading.histograms[name].sum)
        prompt.add_metric([model], reading.prompt_tokens)
        generation.add_metric([model], reading.generation_tokens)
        for reason, count in sorted(reading.success.items()):
            success.add_metric([model, reason], count)
    yield from (*hists.values(), prompt, generation, success)


class _Scrape(Collector):
    """One scrape's families: the process' own registry and those read from Redis."""

    def __init__(self, parts: Iterable[Collector | list[Metric]]):
        self.parts = parts

    def collect(self) -> Iterator[Metric]:
        for part in self.parts:
            yield from part if isinstance(part, list) else part.collect()
