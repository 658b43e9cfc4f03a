"""A finished job's facts as hash increments, and the hash read back as Prometheus histograms and counters."""

from __future__ import annotations

from chatq.core import metrics
from chatq.core.metrics import E2E, ITL, QUEUE_TIME, TTFT, JobFacts, Tally


def summed(*increments: dict[str, float]) -> dict[str, str]:
    """The hash after these HINCRBYFLOATs, as Redis gives it back."""
    total: dict[str, float] = {}
    for inc in increments:
        for k, v in inc.items():
            total[k] = total.get(k, 0) + v
    return {k: repr(v) for k, v in total.items()}


def test_a_value_counts_in_the_first_bucket_it_does_not_exceed():
    tally = Tally(ITL)
    for gap in (0.01, 0.0100001, 80.0, 81.0):
        tally.add(gap)
    assert tally.increments() == {
        "itl:le:0.01": 1,
        "itl:le:0.025": 1,
        "itl:le:80.0": 1,
        "itl:le:+Inf": 1,
        "itl:sum": 0.01 + 0.0100001 + 80.0 + 81.0,
        "itl:count": 4,
    }


def test_jobs_read_back_as_cumulative_histograms_and_counters():
    first = JobFacts(e2e=2.0, queue_time=0.2, ttft=0.3, prompt_tokens=10, generation_tokens=4, finished_reason="length")
    for gap in (0.02, 0.02, 0.3):
        first.itl.add(gap)
    second = JobFacts(e2e=9000.0, queue_time=-0.01, ttft=None, prompt_tokens=5, finished_reason="abort")
    reading = metrics.read(summed(first.increments(), second.increments()))

    assert (reading.prompt_tokens, reading.generation_tokens) == (15, 4)
    assert reading.success == {"length": 1, "abort": 1}
    e2e = dict(reading.histograms[E2E.name].buckets)
    assert (e2e["1.5"], e2e["2.0"], e2e["7680.0"], e2e["+Inf"]) == (0, 1, 1, 2)
    assert reading.histograms[E2E.name].sum == 9002.0
    # A clock a little behind the API's counts as no wait; a job that never generated has no first token.
    assert dict(reading.histograms[QUEUE_TIME.name].buckets)["0.3"] == 2
    assert reading.histograms[TTFT.name].buckets[-1] == ("+Inf", 1)
    itl = reading.histograms[ITL.name].buckets
    assert [n for _, n in itl][:3] == [0, 2, 2] and itl[-1] == ("+Inf", 3)


def test_an_empty_hash_reads_as_zeros_and_unknown_buckets_are_left_out():
    empty = metrics.read({})
    assert empty.success == {} and empty.prompt_tokens == 0
    assert all(
        h.buckets[-1] == ("+Inf", 0) and len(h.buckets) == len(m.buckets) + 1
        for h, m in zip(empty.histograms.values(), metrics.HISTOGRAMS, strict=True)
    )
    # Written by a version with other buckets: still a valid histogram, +Inf its count.
    odd = metrics.read({"ttft:le:0.3": "2", "ttft:le:0.25": "1", "ttft:count": "3", "ttft:sum": "0.8"})
    ttft = dict(odd.histograms[TTFT.name].buckets)
    assert (ttft["0.25"], ttft["0.5"], ttft["+Inf"]) == (1, 1, 3)
