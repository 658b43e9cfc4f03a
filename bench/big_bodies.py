"""What bodies at the size limit cost everyone else: /health's latency while many of them are being rendered.

Run from the repository root:

    .venv/bin/python bench/big_bodies.py [--bodies 8] [--size-mib 3.9] [--runs 3]

A worker and an API on an embedded Redis. Each run sends --bodies chat requests at once, each one message of
--size-mib MiB of text (just under CHATQ_MAX_BODY_BYTES, so the API reads, renders and tokenizes it whole before it
answers 400 for the context length), and meanwhile asks GET /health every 20 ms. Then one body over the limit,
which must be a 413 before it is read. Printed per run: how long the big requests took, and /health's latency
(p50 / p99 / max) while they ran, beside /health on an idle API.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Services, ms, pct, table  # noqa: E402


def big_body(size: int) -> dict:
    words = ("lorem ipsum dolor sit amet consectetur " * (size // 40 + 1))[:size]
    return {"messages": [{"role": "user", "content": words}], "max_tokens": 1}


async def health_latencies(client: httpx.AsyncClient, base: str, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        start = time.perf_counter()
        resp = await client.get(f"{base}/health")
        out.append(time.perf_counter() - start)
        assert resp.status_code == 200, resp.text
        await asyncio.sleep(0.02)
    return out


async def one_run(base: str, bodies: int, size: int) -> tuple[float, list[float], set[int]]:
    """The big requests' wall time, /health's latencies meanwhile, and the big requests' statuses."""
    async with httpx.AsyncClient(timeout=300) as client:
        stop = asyncio.Event()
        health = asyncio.create_task(health_latencies(client, base, stop))
        body = big_body(size)
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.post(f"{base}/v1/chat/completions", json=body) for _ in range(bodies)))
        wall = time.perf_counter() - start
        stop.set()
        return wall, await health, {a.status_code for a in answers}


async def idle_health(base: str) -> list[float]:
    async with httpx.AsyncClient(timeout=30) as client:
        stop = asyncio.Event()
        task = asyncio.create_task(health_latencies(client, base, stop))
        await asyncio.sleep(2)
        stop.set()
        return await task


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bodies", type=int, default=8)
    ap.add_argument("--size-mib", type=float, default=3.9)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    size = int(args.size_mib * 1024 * 1024)
    rows = []
    with Services(worker_concurrency=8) as svc:
        idle = asyncio.run(idle_health(svc.base_url))
        rows.append(["idle", "", "", f"{ms(pct(idle, 50))} / {ms(pct(idle, 99))} / {ms(max(idle))}"])
        for i in range(args.runs):
            wall, health, statuses = asyncio.run(one_run(svc.base_url, args.bodies, size))
            spread = f"{ms(pct(health, 50))} / {ms(pct(health, 99))} / {ms(max(health))}"
            rows.append([f"run {i + 1}", f"{wall:.1f}", ",".join(map(str, sorted(statuses))), spread])
        over = httpx.post(f"{svc.base_url}/v1/chat/completions", json=big_body(size * 2), timeout=60)
    print(f"{args.bodies} bodies of {args.size_mib} MiB at once; /health every 20 ms meanwhile")
    print(table(["", "big requests s", "their status", "/health ms p50 / p99 / max"], rows))
    print(f"a body of {2 * args.size_mib:.1f} MiB: {over.status_code} {over.json()['error']['type']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
