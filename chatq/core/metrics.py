"""The per-request metrics every API replica reports alike: what a finished job adds to its model's Redis hash
(keys.metrics), and how that hash reads back as Prometheus histograms and counters.

The worker that ends a job adds its facts in the job's last write (worker_scripts.update_record), so a background job no
API request waits on counts as much as a streamed one, and every replica reads the same numbers. Histograms are kept
as one counter per bucket (not cumulative), plus their sum and count; names and buckets follow vLLM's.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

PREFIX = "chatq:"
INF = "+Inf"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards made for it read these too.
# fmt: off
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
# fmt: on


@dataclass(frozen=True)
class Histogram:
    field: str  # its fields' prefix in the hash
    name: str
    help: str
    buckets: tuple[float, ...]

    def bucket(self, value: float) -> int:
        """The index of the bucket `value` falls in: its first bound not exceeded, len(buckets) for +Inf."""
        return bisect.bisect_left(self.buckets, value)

    def bucket_field(self, index: int) -> str:
        """The hash field of bucket `index`."""
        return f"{self.field}:le:{_bound(self.buckets[index]) if index < len(self.buckets) else INF}"


QUEUE_TIME = Histogram(
    "queue",
    "request_queue_time_seconds",
    "Seconds a request waited in the queue for a worker.",
    REQUEST_LATENCY_BUCKETS,
)
TTFT = Histogram(
    "ttft",
    "time_to_first_token_seconds",
    "Seconds from a request's submission to its first generated token.",
    TTFT_BUCKETS,
)
ITL = Histogram(
    "itl", "inter_token_latency_seconds", "Seconds between two tokens of one choice of a request.", ITL_BUCKETS
)
E2E = Histogram(
    "e2e",
    "e2e_request_latency_seconds",
    "Seconds from a request's submission to its end on a worker.",
    REQUEST_LATENCY_BUCKETS,
)
HISTOGRAMS = (QUEUE_TIME, TTFT, ITL, E2E)

PROMPT_TOKENS = "prompt_tokens"
GENERATION_TOKENS = "generation_tokens"
SUCCESS = "success"  # success:<finished_reason>


def _bound(b: float) -> str:
    return repr(float(b))


class Tally:
    """Observations of one histogram, counted by bucket before they go to Redis: a job's many inter-token gaps
    become a few increments. Counted by bucket index, and named only at the end: `add` runs for every token."""

    def __init__(self, histogram: Histogram):
        self.histogram = histogram
        self.counts = [0] * (len(histogram.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def add(self, value: float) -> None:
        self.counts[self.histogram.bucket(value)] += 1
        self.sum += value
        self.count += 1

    def increments(self) -> dict[str, float]:
        if not self.count:
            return {}
        f = self.histogram.field
        counted = {self.histogram.bucket_field(i): n for i, n in enumerate(self.counts) if n}
        return {**counted, f"{f}:sum": self.sum, f"{f}:count": self.count}


@dataclass
class JobFacts:
    """What one job adds to its model's metrics when it ends. Times are in seconds; None: not known for this job
    (a job that generated nothing has no first token)."""

    e2e: float
    queue_time: float | None
    ttft: float | None
    itl: Tally = field(default_factory=lambda: Tally(ITL))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_reason: str = "stop"

    def increments(self) -> dict[str, float]:
        """The hash fields to add to, and by how much."""
        out: dict[str, float] = {PROMPT_TOKENS: self.prompt_tokens, GENERATION_TOKENS: self.generation_tokens}
        out[f"{SUCCESS}:{self.finished_reason}"] = 1
        for histogram, value in ((E2E, self.e2e), (QUEUE_TIME, self.queue_time), (TTFT, self.ttft)):
            if value is not None:
                single = Tally(histogram)
                single.add(max(value, 0.0))  # clocks of two hosts may disagree a little
                out |= single.increments()
        return out | self.itl.increments()


@dataclass
class HistogramReading:
    buckets: list[tuple[str, float]]  # cumulative, +Inf last, as Prometheus wants them
    sum: float


@dataclass
class ModelReading:
    """One model's metrics as read from its hash."""

    histograms: dict[str, HistogramReading]  # by Histogram.name
    prompt_tokens: float
    generation_tokens: float
    success: dict[str, float]  # by finished_reason


def read(fields: Mapping[str, str]) -> ModelReading:
    """A model's hash (keys.metrics) -> its metrics. Buckets this version does not know are left out, so a hash
    written by another version still reads as a valid histogram."""
    values = {k: float(v) for k, v in fields.items()}
    histograms = {h.name: _histogram(h, values) for h in HISTOGRAMS}
    success = {k.removeprefix(f"{SUCCESS}:"): v for k, v in values.items() if k.startswith(f"{SUCCESS}:")}
    return ModelReading(histograms, values.get(PROMPT_TOKENS, 0.0), values.get(GENERATION_TOKENS, 0.0), success)


def _histogram(h: Histogram, values: Mapping[str, float]) -> HistogramReading:
    buckets, total = [], 0.0
    for b in h.buckets:
        total += values.get(f"{h.field}:le:{_bound(b)}", 0.0)
        buckets.append((_bound(b), total))
    buckets.append((INF, max(values.get(f"{h.field}:count", 0.0), total)))
    return HistogramReading(buckets, values.get(f"{h.field}:sum", 0.0))
