"""Soak: many clients mixing every way of using a job, with a worker SIGKILLed and restarted midway.

Run from the repository root:

    .venv/bin/python bench/soak.py [--jobs 1000] [--clients 50] [--result-ttl 60] [--no-kill] [--keep-logs]

Two workers of the default model and an API on an embedded Redis. Each client takes the next job and runs it one
of five ways, in turn: streamed, non-streamed, background (polled to its end), background cancelled a moment after
submitting, and streamed with the client disconnecting after two events. Once half the jobs were submitted one
worker is SIGKILLed and another started. Every job is then followed to its end and its event log replayed from the
start; a job is lost if it never ends or its record vanishes before it does. After the results' TTL, Redis should
hold what it held before the load.

Prints jobs lost, event logs with a missing or repeated sequence number, 5xx answers, how the jobs ended, and
Redis' keys and memory before and after (targets: 0, 0, 0, and keys back to the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Services, http_client, table  # noqa: E402

KINDS = ("stream", "plain", "background", "cancel", "disconnect")
FINAL = {"completed", "failed", "cancelled"}


@dataclass
class Tally:
    lost: list[str] = field(default_factory=list)
    broken_logs: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)
    ended: Counter[str] = field(default_factory=Counter)

    def http(self, resp: httpx.Response, what: str) -> None:
        if resp.status_code >= 500:
            self.server_errors.append(f"{what}: {resp.status_code} {resp.text[:200]}")


def body(i: int, rng: random.Random, **extra: Any) -> dict[str, Any]:
    content = f"Say one thing about the number {i}."
    return {"messages": [{"role": "user", "content": content}], "max_tokens": rng.randint(4, 24), **extra}


async def stream_ids(resp: httpx.Response, limit: int | None = None) -> tuple[list[int], str | None]:
    """The event ids of an SSE response (up to `limit` events) and the job's id from its first chunk."""
    ids, job_id = [], None
    async for line in resp.aiter_lines():
        if line.startswith("id:"):
            ids.append(int(line[3:]))
        elif line.startswith("data:") and job_id is None and line[5:].strip().startswith("{"):
            job_id = json.loads(line[5:]).get("id")
        if limit is not None and len(ids) >= limit:
            break
    return ids, job_id


async def submit(
    client: httpx.AsyncClient, base: str, kind: str, i: int, rng: random.Random, tally: Tally
) -> str | None:
    """Runs job `i` the `kind` way as far as its client goes; the job's id."""
    url = f"{base}/v1/chat/completions"
    if kind in ("stream", "disconnect"):
        async with client.stream("POST", url, json=body(i, rng, stream=True)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                tally.http(resp, f"job {i}")
                return None
            _, job_id = await stream_ids(resp, 2 if kind == "disconnect" else None)
        return job_id
    resp = await client.post(url, json=body(i, rng, background=kind != "plain"))
    tally.http(resp, f"job {i}")
    if resp.status_code not in (200, 202):
        return None
    job_id = resp.json()["id"]
    if kind == "cancel":
        await asyncio.sleep(rng.random() * 0.5)
        tally.http(await client.post(f"{url}/{job_id}/cancel"), f"cancel {job_id}")
    return job_id


async def follow(client: httpx.AsyncClient, base: str, job_id: str, tally: Tally, timeout: float) -> None:
    """Waits for the job to end, then checks its replayed log: 1, 2, 3, ... and `done` last."""
    url = f"{base}/v1/chat/completions/{job_id}"
    deadline = time.time() + timeout
    while True:
        resp = await client.get(url)
        tally.http(resp, f"poll {job_id}")
        status = resp.json().get("status") if resp.status_code == 200 else None
        if status in FINAL:
            break
        if resp.status_code == 404 or time.time() > deadline:
            tally.lost.append(job_id)
            return
        await asyncio.sleep(0.2)
    tally.ended[status] += 1
    async with client.stream("GET", f"{url}?stream=true") as replay:
        if replay.status_code != 200:
            await replay.aread()
            tally.http(replay, f"replay {job_id}")
            tally.broken_logs.append(f"{job_id}: replay answered {replay.status_code}")
            return
        ids, _ = await stream_ids(replay)
    if ids != list(range(1, len(ids) + 1)) or not ids:
        tally.broken_logs.append(f"{job_id}: {ids}")


async def load(
    base_url: str, jobs: int, clients: int, tally: Tally, kill: Callable[[], None] | None, job_timeout: float = 600
) -> None:
    """`jobs` jobs from `clients` clients; `kill` (SIGKILL a worker, start another) runs once half are submitted."""
    rng = random.Random(7)
    counter = iter(range(jobs))

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal kill
        for i in counter:
            if i >= jobs // 2 and kill is not None:
                kill, killing = None, kill
                killing()
            job_id = await submit(client, base_url, KINDS[i % len(KINDS)], i, rng, tally)
            if job_id is not None:
                await follow(client, base_url, job_id, tally, job_timeout)

    async with http_client(timeout=job_timeout) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))


def memory(r: redis.Redis) -> str:
    """Redis' data set (used memory less its fixed and per-connection overhead), and its connections' buffers."""
    info = r.info("memory")
    return f"{info['used_memory_dataset']} + {info['mem_clients_normal']} clients"


def redis_keys(r: redis.Redis) -> int:
    return sum(1 for _ in r.scan_iter("*"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {"CHATQ_RESULT_TTL": str(args.result_ttl), "CHATQ_WORKER_TTL": str(args.worker_ttl)}
    with Services(worker_concurrency=32, workers=2, keep_logs=args.keep_logs, extra_env=env) as svc:
        r = redis.Redis.from_url(svc.settings.redis_url, decode_responses=True)
        keys_before, memory_before = redis_keys(r), memory(r)
        tally = Tally()

        def kill() -> None:
            victim = next(p for p in svc.procs if p.name.startswith("worker") and p.alive())
            victim.popen.send_signal(signal.SIGKILL)
            svc.add_worker()

        start = time.time()
        asyncio.run(load(svc.base_url, args.jobs, args.clients, tally, kill if args.kill else None, args.job_timeout))
        wall = time.time() - start
        time.sleep(args.result_ttl + 2)  # every result expires
        keys_after, memory_after = redis_keys(r), memory(r)
        leftover = sorted(r.scan_iter("*"))
    return {
        "jobs": args.jobs,
        "clients": args.clients,
        "wall_s": round(wall, 1),
        "lost": tally.lost,
        "broken_logs": tally.broken_logs,
        "server_errors": tally.server_errors,
        "ended": dict(tally.ended),
        "keys_before": keys_before,
        "keys_after": keys_after,
        "leftover_keys": leftover if keys_after > keys_before else [],
        "memory_before": memory_before,
        "memory_after": memory_after,
    }


def report(result: dict[str, Any]) -> None:
    rows = [
        ["jobs lost", str(len(result["lost"])), "0"],
        ["logs with a gap or a repeat", str(len(result["broken_logs"])), "0"],
        ["5xx answers", str(len(result["server_errors"])), "0"],
        ["Redis keys before / after", f"{result['keys_before']} / {result['keys_after']}", "equal"],
        ["Redis data set bytes before", result["memory_before"], ""],
        ["Redis data set bytes after", result["memory_after"], ""],
    ]
    print(table(["", "measured", "target"], rows))
    print(f"{result['jobs']} jobs from {result['clients']} clients in {result['wall_s']} s; ended: {result['ended']}")
    for name in ("lost", "broken_logs", "server_errors", "leftover_keys"):
        for item in result[name][:10]:
            print(f"  {name}: {item}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--result-ttl", type=int, default=60, help="CHATQ_RESULT_TTL of the run, seconds")
    ap.add_argument("--worker-ttl", type=int, default=5, help="CHATQ_WORKER_TTL of the run, seconds")
    ap.add_argument("--job-timeout", type=float, default=600, help="seconds a job may take before it counts as lost")
    ap.add_argument("--no-kill", dest="kill", action="store_false", help="no worker is killed")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    result = run(args)
    report(result)
    ok = not (result["lost"] or result["broken_logs"] or result["server_errors"])
    return 0 if ok and result["keys_after"] <= result["keys_before"] else 1


if __name__ == "__main__":
    sys.exit(main())
