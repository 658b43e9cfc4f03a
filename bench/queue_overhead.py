"""What the queue costs: chatq's whole stack (API, Redis, Celery, runner, relay) with a zero-cost generator.

Run from the repository root (the script puts the root on sys.path; `python -m bench.queue_overhead` works too):

    .venv/bin/python bench/queue_overhead.py [--rate 100] [--duration 10] [--streams 200] [--stream-tokens 2000]
                                             [--out results.json] [--keep-logs]

The worker is bench/zero_worker.py: the product's Celery app, task and Runner around an engine that emits one
token (" hello") per sequence per step instantly, so whatever time a request takes is the service's overhead.

1. latency: requests arrive at a fixed rate (--rate per second for --duration seconds, open loop), max_tokens 1, once
   non-streamed and once streamed. End-to-end latency p50/p99 is the latency the service adds per request. Split by
   the job record's timestamps: client send -> worker claim (`started`: HTTP, validation, rendering, the submit
   script that records the job and enqueues its task, Celery's delivery), claim -> last write (`finished`: runner and
   publish), last write -> client has the response (relay, HTTP). Two more runs at the same rate for the breakdown,
   not for the targets: `background: true` times the submit path alone (its "e2e" is the time to the 202), and
   `http-floor` is GET /v1/models, the cost of the client, HTTP and FastAPI without Redis or a job. Beside them, the
   round trip of a Redis PING from this process: a request crosses Redis about ten times on its way (submit,
   delivery, the worker's bookkeeping, claim, step write, pub/sub, ack), so on a machine where one round trip takes
   0.2 ms that floor alone is a few milliseconds.
2. relay: --streams concurrent streams of --stream-tokens instant tokens each; relayed chunks/s = SSE data frames
   received by all clients / wall time. The streams must be long enough to run at once: the zero-cost engine makes
   500 tokens in about two seconds, less than the worker takes to start 200 jobs here, so at 500 tokens an engine
   step carried 55-87 streams on average, at 2,000 about 150. Beside it: the events the worker published per second,
   its engine loop (steps/s, tokens per step, time per step and the part of it in Publisher.flush) and its full
   garbage collections (how many, and how long they stopped it in all), from bench/zero_worker.py's counters.
Every phase prints the CPU each process used, as % of one core (a process near 100% is the bottleneck; on a shared
machine, low numbers everywhere with high latency mean the processes were waiting for a CPU) and as CPU time per
request or relayed frame, which bounds the rate one core can sustain whatever else runs on the machine.
Targets (from the issue): added latency p50 <= 5 ms and p99 <= 25 ms at 100 requests/s; >= 20,000 relayed chunks/s
from one API process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import redis
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    NOOP_TASK,
    STATS_KEY,
    Services,
    cpu_seconds,
    ms,
    own_cpu_seconds,
    pct,
    table,
    write_json,
)
from chatq.core import keys  # noqa: E402
from chatq.core.queue import celery_priority, make_celery  # noqa: E402

LATENCY_P50, LATENCY_P99, CHUNKS_PER_S = 0.005, 0.025, 20_000


@dataclass
class Sample:
    send: float
    first: float | None  # first content chunk (streamed only)
    recv: float
    job_id: str | None
    error: str | None = None


@dataclass
class LatencyRow:
    mode: str
    requests: int
    errors: int
    achieved_rate: float
    e2e_p50_s: float
    e2e_p99_s: float
    e2e_max_s: float
    first_p50_s: float
    to_claim_p50_s: float
    to_claim_p99_s: float
    worker_p50_s: float
    worker_p99_s: float
    relay_p50_s: float
    relay_p99_s: float
    cpu: dict[str, float] = field(default_factory=dict)  # % of one core
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds
    error_kinds: list[str] = field(default_factory=list)


@dataclass
class RelayRow:
    streams: int
    tokens_per_stream: int
    incomplete: int
    frames: int
    wall_s: float
    frames_per_s: float
    published_per_s: float
    steps_per_s: float
    tokens_per_step: float
    step_ms: float  # engine loop wall time per step
    flush_ms: float  # of which Publisher.flush (serialising events, one Redis pipeline)
    gc_full: int  # the worker's full garbage collections during the phase
    gc_full_ms: float  # and the time they stopped it for, in all
    cpu: dict[str, float] = field(default_factory=dict)  # % of one core
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds
    error_kinds: list[str] = field(default_factory=list)


class CpuMeter:
    """CPU seconds per service process (and this client) over a phase, as a percentage of one core."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.t0 = time.time()
        self.before = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"client": own_cpu_seconds()}

    def read(self) -> tuple[dict[str, float], dict[str, float]]:
        """(% of one core, CPU seconds) per process since the meter was made."""
        wall = time.time() - self.t0
        after = {name: cpu_seconds(pid) for name, pid in self.pids.items()} | {"client": own_cpu_seconds()}
        used = {name: after[name] - self.before[name] for name in after}
        return {name: 100 * v / wall for name, v in used.items()}, used


MODES = ("non-streamed", "streamed", "background", "http-floor")


def body(model: str, mode: str, max_tokens: int) -> dict[str, Any]:
    b: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
    if mode == "streamed":
        b |= {"stream": True, "stream_options": {"include_usage": True}}
    if mode == "background":
        b["background"] = True
    return b


def session(timeout: float, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    # aiohttp, not httpx, in this client: its C parsers cost a fraction of httpx's pure-Python HTTP/1.1 per request
    # and per received chunk, and this client shares the machine's cores with the services it measures.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),  # no pool limit: every stream and request gets its own connection
        timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=30),
        headers=headers,
    )


async def one_request(client: aiohttp.ClientSession, url: str, b: dict[str, Any]) -> Sample:
    send = time.time()
    first: float | None = None
    job_id, error = None, None
    try:
        if not b:  # the HTTP floor: GET /v1/models touches neither Redis nor the worker
            async with client.get(url) as r:
                await r.read()
                return Sample(send, None, time.time(), None, None if r.status == 200 else f"HTTP {r.status}")
        async with client.post(url, json=b) as r:
            if r.status != (202 if b.get("background") else 200):
                return Sample(send, None, time.time(), None, f"HTTP {r.status}: {(await r.text())[:200]}")
            if not b.get("stream"):
                answer = await r.read()
                return Sample(send, None, time.time(), orjson.loads(answer).get("id"))
            async for line in r.content:  # read to the end of the response, so its connection is reused
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                obj = orjson.loads(line[5:])
                if "error" in obj:
                    error = str(obj["error"])[:200]
                job_id = job_id or obj.get("id")
                if first is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices") or []):
                    first = time.time()
    except (aiohttp.ClientError, TimeoutError) as e:
        return Sample(send, first, time.time(), job_id, repr(e))
    return Sample(send, first, time.time(), job_id, error)


async def open_loop(
    url: str, b: dict[str, Any], rate: float, duration: float, headers: dict[str, str] | None = None
) -> tuple[list[Sample], float]:
    """Sends request i at start + i / rate whatever the answers do; returns the samples and the sending time."""
    n = max(1, int(rate * duration))
    async with session(timeout=60, headers=headers) as client:
        tasks = []
        start = time.time()
        for i in range(n):
            delay = start + i / rate - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, url, b)))
        sent = time.time() - start
        return list(await asyncio.gather(*tasks)), sent


def job_times(r: redis.Redis, samples: list[Sample]) -> list[tuple[Sample, float, float]]:
    """(sample, started, finished) for each successful sample, from the job records."""
    ok = [s for s in samples if s.error is None and s.job_id]
    pipe = r.pipeline(transaction=False)
    for s in ok:
        pipe.hmget(keys.job(s.job_id), "started", "finished")  # type: ignore[arg-type]
    out = []
    for s, (started, finished) in zip(ok, pipe.execute(), strict=True):
        if started and finished:
            out.append((s, float(started), float(finished)))
    return out


def latency_phase(svc: Services, r: redis.Redis, mode: str, args: argparse.Namespace) -> LatencyRow:
    url = f"{svc.base_url}/v1/models" if mode == "http-floor" else f"{svc.base_url}/v1/chat/completions"
    b = {} if mode == "http-floor" else body(svc.settings.model_name, mode, 1)
    meter = CpuMeter(svc.pids)
    samples, sent = uvloop.run(open_loop(url, b, args.rate, args.duration))
    cpu, cpu_s = meter.read()
    time.sleep(0.5)  # background jobs: let the last ones finish before their records are read
    ok = [s for s in samples if s.error is None]
    e2e = [s.recv - s.send for s in ok]
    firsts = [s.first - s.send for s in ok if s.first is not None]
    times = job_times(r, samples)
    errors = sorted({s.error for s in samples if s.error})
    if errors:
        print(f"  {mode} errors: {errors[:3]}")
    relay = [] if mode == "background" else [s.recv - fin for s, _, fin in times]
    return LatencyRow(
        mode,
        len(samples),
        len(samples) - len(ok),
        len(samples) / sent if sent > 0 else 0.0,
        pct(e2e, 50),
        pct(e2e, 99),
        max(e2e, default=float("nan")),
        pct(firsts, 50),
        pct([st - s.send for s, st, _ in times], 50),
        pct([st - s.send for s, st, _ in times], 99),
        pct([fin - st for _, st, fin in times], 50),
        pct([fin - st for _, st, fin in times], 99),
        pct(relay, 50),
        pct(relay, 99),
        cpu,
        cpu_s,
        errors[:5],
    )


async def count_frames(client: aiohttp.ClientSession, url: str, b: dict[str, Any]) -> tuple[int, bool, str | None]:
    """SSE data frames of one stream (not parsed, so the client stays cheap), whether [DONE] came, and any error."""
    frames, tail, done = 0, b"", False
    try:
        async with client.post(url, json=b) as resp:
            if resp.status != 200:
                return 0, False, f"HTTP {resp.status}: {(await resp.text())[:200]}"
            async for chunk in resp.content.iter_any():
                buf = tail + chunk
                frames += buf.count(b"data:") - tail.count(b"data:")
                done = done or b"[DONE]" in buf
                tail = buf[-5:]  # a marker split between two reads is whole in the next buffer
    except (aiohttp.ClientError, TimeoutError) as e:
        return frames, False, f"{type(e).__name__}: {e}"
    return frames - done, done, None


def publish_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))


def worker_stats(r: redis.Redis) -> dict[str, float]:
    return {str(k): float(v) for k, v in r.hgetall(STATS_KEY).items()}


def relay_phase(svc: Services, r: redis.Redis, args: argparse.Namespace) -> RelayRow:
    url = f"{svc.base_url}/v1/chat/completions"
    b = body(svc.settings.model_name, "streamed", args.stream_tokens)

    async def run() -> tuple[list[tuple[int, bool, str | None]], float]:
        async with session(timeout=900) as client:
            start = time.time()
            got = await asyncio.gather(*(count_frames(client, url, b) for _ in range(args.streams)))
            return list(got), time.time() - start

    published = publish_calls(r)
    meter = CpuMeter(svc.pids)
    before = worker_stats(r)
    results, wall = uvloop.run(run())
    time.sleep(0.3)  # one more report of the worker's counters
    after = worker_stats(r)
    cpu, cpu_s = meter.read()
    published = publish_calls(r) - published
    frames = sum(f for f, _, _ in results)
    errors = sorted({e for _, _, e in results if e})
    if errors:
        print(f"  stream errors: {errors[:3]}")
    d = {k: after[k] - before.get(k, 0) for k in after}
    steps = d.get("steps", 0) or float("nan")
    return RelayRow(
        args.streams,
        args.stream_tokens,
        sum(not done for _, done, _ in results),
        frames,
        wall,
        frames / wall,
        published / wall,
        steps / wall,
        d.get("tokens", 0) / steps,
        1000 * wall / steps,
        1000 * d.get("flush_s", 0) / steps,
        int(d.get("gc_full", 0)),
        1000 * d.get("gc_full_s", 0),
        cpu,
        cpu_s,
        errors[:5],
    )


def warm_up(svc: Services) -> None:
    """A few requests first; the answer also proves the zero-cost engine is the one running."""
    url = f"{svc.base_url}/v1/chat/completions"
    for _ in range(5):
        r = httpx.post(url, json=body(svc.settings.model_name, "non-streamed", 3), timeout=60)
        r.raise_for_status()
    content = r.json()["choices"][0]["message"]["content"]
    if content.strip() != "hello hello hello":
        raise RuntimeError(f"the worker is not the zero-cost double: it answered {content!r}")


def celery_floor(svc: Services, args: argparse.Namespace) -> float:
    """Worker CPU seconds per no-op task sent at the latency phases' rate: Celery's receive, thread pool and late
    ack, with none of chatq's work."""
    app = make_celery(svc.settings)
    queue = keys.celery_queue(svc.settings.model_name)
    n = max(1, int(args.rate * args.duration))
    before, start = cpu_seconds(svc.pids["worker"]), time.time()
    for i in range(n):
        app.send_task(NOOP_TASK, args=[str(i)], queue=queue, priority=celery_priority(0))
        delay = start + (i + 1) / args.rate - time.time()
        if delay > 0:
            time.sleep(delay)
    with redis.Redis.from_url(svc.settings.redis_url) as r:  # until every task ran and was acknowledged
        while any(r.llen(k) for k in r.scan_iter(f"{queue}*")) or r.hlen("unacked"):
            time.sleep(0.05)
    time.sleep(0.3)
    return (cpu_seconds(svc.pids["worker"]) - before) / n


def redis_round_trip(r: redis.Redis, n: int = 500) -> float:
    """p50 seconds of one PING from this process on an idle stack."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        r.ping()
        times.append(time.perf_counter() - start)
    return pct(times, 50)


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=100, help="requests per second in the latency phases")
    parser.add_argument("--duration", type=float, default=10, help="seconds of arrivals in each latency phase")
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams in the relay phase")
    parser.add_argument("--stream-tokens", type=int, default=2000, help="max_tokens of each relay-phase stream")
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs (path printed at the end)")
    args = parser.parse_args(argv)

    # Enough task threads that no relay-phase stream waits for a free one.
    with Services(
        max(64, args.streams + 8), worker_app="bench.zero_worker", device="cpu", keep_logs=args.keep_logs
    ) as svc:
        r = redis.Redis.from_url(svc.settings.redis_url, decode_responses=True)
        warm_up(svc)
        rtt = redis_round_trip(r)
        print(f"latency: {args.rate:g} requests/s for {args.duration:g} s, max_tokens 1 ...")
        lat = [latency_phase(svc, r, mode, args) for mode in MODES]
        print(f"relay: {args.streams} streams x {args.stream_tokens} tokens ...")
        relay = relay_phase(svc, r, args)
        print(f"celery floor: {args.rate:g} no-op tasks/s for {args.duration:g} s ...")
        floor_s = celery_floor(svc, args)
        r.close()

    names = ["api", "worker", "redis", "client"]
    print(f"\nzero-cost generator; latency phases at {args.rate:g} requests/s for {args.duration:g} s, max_tokens 1\n")
    headers = ["mode", "reqs", "err", "req/s", "e2e p50 ms", "e2e p99 ms", "e2e max ms", "1st chunk p50"]
    headers += ["->claim p50", "->claim p99", "worker p50", "worker p99", "relay p50", "relay p99"]
    print(
        table(
            headers,
            [
                [x.mode, x.requests, x.errors, f"{x.achieved_rate:.1f}", ms(x.e2e_p50_s), ms(x.e2e_p99_s)]
                + [ms(x.e2e_max_s), ms(x.first_p50_s), ms(x.to_claim_p50_s), ms(x.to_claim_p99_s)]
                + [ms(x.worker_p50_s), ms(x.worker_p99_s), ms(x.relay_p50_s), ms(x.relay_p99_s)]
                for x in lat
            ],
        )
    )
    print(f"\nrelay: {args.streams} concurrent streams x {args.stream_tokens} instant tokens\n")
    print(
        table(
            ["streams", "tokens", "incomplete", "frames", "wall s", "relayed frames/s", "published/s"]
            + ["steps/s", "tokens/step", "ms/step", "flush ms/step", "worker full GCs", "GC ms"],
            [
                [relay.streams, relay.tokens_per_stream, relay.incomplete, relay.frames, f"{relay.wall_s:.2f}"]
                + [f"{relay.frames_per_s:.0f}", f"{relay.published_per_s:.0f}", f"{relay.steps_per_s:.1f}"]
                + [f"{relay.tokens_per_step:.1f}", f"{relay.step_ms:.2f}", f"{relay.flush_ms:.2f}"]
                + [relay.gc_full, f"{relay.gc_full_ms:.0f}"]
            ],
        )
    )
    print("\nCPU per process during each phase: % of one core, and CPU microseconds per request (per frame: relay)\n")
    units = [(x.mode, x.cpu, x.cpu_s, x.requests) for x in lat] + [("relay", relay.cpu, relay.cpu_s, relay.frames)]
    print(
        table(
            ["phase", *(f"{n} %" for n in names), *(f"{n} us/unit" for n in names)],
            [
                [
                    mode,
                    *(f"{cpu.get(n, 0):.0f}" for n in names),
                    *(f"{1e6 * cpu_s.get(n, 0) / max(k, 1):.0f}" for n in names),
                ]
                for mode, cpu, cpu_s, k in units
            ],
        )
    )

    bg, floor = lat[MODES.index("background")], lat[MODES.index("http-floor")]
    print(f"\nhttp-floor: GET /v1/models (client + HTTP + FastAPI, no Redis): p50 {ms(floor.e2e_p50_s)} ms")
    print(f"Redis round trip (PING from the load generator, idle stack): p50 {ms(rtt)} ms")
    print(
        f"Celery floor: a task that does nothing, sent at {args.rate:g}/s to the same worker, costs it"
        f" {ms(floor_s)} ms of CPU (a job costs the worker {ms(lat[0].cpu_s.get('worker', 0) / lat[0].requests)} ms)"
    )
    print(
        f"\nbackground: send -> 202 p50 {ms(bg.e2e_p50_s)} ms, send -> worker claim p50 {ms(bg.to_claim_p50_s)} ms"
        " (the task is enqueued with the job record before the 202 is written, so the difference is Celery's"
        f" delivery + claim minus the API's work after the submit: {ms(bg.to_claim_p50_s - bg.e2e_p50_s)} ms)"
    )
    verdicts = []
    for x in lat:
        if x.mode not in ("non-streamed", "streamed"):
            continue
        for name, got, limit in (("p50", x.e2e_p50_s, LATENCY_P50), ("p99", x.e2e_p99_s, LATENCY_P99)):
            verdicts.append(
                f"{x.mode} added latency {name} <= {limit * 1000:g} ms: {verdict(got <= limit)} ({ms(got)})"
            )
    got = relay.frames_per_s
    verdicts.append(f"relayed chunks/s >= {CHUNKS_PER_S:,}: {verdict(got >= CHUNKS_PER_S)} ({got:.0f})")
    if args.rate != 100:
        verdicts.append(f"(the latency targets are stated at 100 requests/s; this run used {args.rate:g})")
    print("\ntargets:\n  " + "\n  ".join(verdicts))
    write_json(
        args.out,
        {
            "config": vars(args),
            "redis_round_trip_s": rtt,
            "celery_noop_task_worker_cpu_s": floor_s,
            "latency": [asdict(x) for x in lat],
            "relay": asdict(relay),
            "targets": verdicts,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
