"""The worker's own Prometheus metrics, served on CHATQ_WORKER_METRICS_PORT: its engine's batch, tokens, KV cache,
preemptions, prefix-cache hits and step time, labelled with the model's name.

The counters and gauges are read from the engine's running totals (EngineStats) when scraped, so a step costs them
nothing; only the step time is observed, once per step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chatq.core.metrics import PREFIX
from chatq.core.settings import Settings

if TYPE_CHECKING:
    from chatq.worker.runner import Runner

log = logging.getLogger(__name__)

# From a short decode step on a GPU to a long prefill on a CPU.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LABELS = ["model_name"]


class EngineCollector(Collector):
    """The engine's totals and state, read at each scrape."""

    def __init__(self, runner: Runner, model: str):
        self.runner = runner
        self.model = model

    def collect(self) -> Iterator[Metric]:
        engine = getattr(self.runner, "engine", None)
        if engine is None:  # still loading the model
            return
        stats, held = engine.stats, engine.occupancy()
        gauges = {
            "engine_batch_size": ("Sequences in the engine's last step.", stats.batch_size),
            "engine_num_requests_running": ("Sequences the engine holds cache blocks for.", held.running),
            "engine_num_requests_waiting": ("Sequences in the engine waiting for cache room.", held.waiting),
            "kv_cache_usage_perc": ("KV-cache usage: 1 means every block is held.", held.used_blocks / held.num_blocks),
            "kv_cache_used_blocks": ("KV-cache blocks held by sequences.", held.used_blocks),
            "kv_cache_num_blocks": ("KV-cache blocks in all.", held.num_blocks),
        }
        counters = {
            "engine_steps": ("Engine steps (forward passes).", stats.steps),
            "engine_generation_tokens": ("Tokens generated (sampled).", stats.generation_tokens),
            "engine_prefill_tokens": ("Tokens prefilled: prompts, and preempted ones again.", stats.prefill_tokens),
            "num_preemptions": ("Sequences preempted for want of cache blocks.", stats.preemptions),
            "engine_interrupted_steps": (
                "Steps of batch lines alone given up part way for another request.",
                stats.interrupted,
            ),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", stats.prefix_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_hits),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            gauge.add_metric([self.model], value)
            yield gauge
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            counter.add_metric([self.model], value)
            yield counter
        doc = "How the engine's decode steps run, in the label `mode` (1)."
        mode = GaugeMetricFamily(PREFIX + "engine_mode", doc, labels=[*LABELS, "mode"])
        mode.add_metric([self.model, engine.mode], 1)
        yield mode


def serve(runner: Runner, settings: Settings) -> int:
    """Serves the worker's metrics on its port (none: 0) from a thread of its own; the port, or 0."""
    port = settings.worker_metrics_port
    if not port:
        return 0
    disable_created_metrics()  # as on the API
    registry = CollectorRegistry()
    registry.register(EngineCollector(runner, settings.model_name))
    step = Histogram(
        PREFIX + "engine_step_seconds",
        "Seconds an engine step (one forward pass and its sampling) took.",
        LABELS,
        buckets=STEP_BUCKETS,
        registry=registry,
    )
    runner.on_step = step.labels(settings.model_name).observe
    # Every interface: the scraper runs on another host (or container) as a rule.
    start_http_server(port, registry=registry)
    log.info("worker metrics on port %d", port)
    return port
