"""The fair share of one worker between API keys, on the real stack (one CPU worker of the default model).

Run from the repository root:

    .venv/bin/python bench/fair_share.py [--slots 8] [--flood 2000] [--every 2] [--for 60] [--window 60]
                                         [--backlog 64]
                                         [--out results.json]

1. **wait**: key A submits --flood background jobs at once (max_tokens 8, greedy, ignore_eos); key B then submits one
   background job every --every seconds for --for seconds. B's queue wait is its job's claim minus its submit; the
   time the worker needs to free one slot, for each of B's jobs, is from its submit to the first of A's jobs to
   finish after it, in the same run. Run once with the fair share on and once off (CHATQ_FAIR_SHARE=false: first
   come first served).
2. **weights**: two managed keys of weights 3 and 1 keep --backlog background jobs each queued (max_tokens 16);
   after a warm-up, the output tokens each is served over --window seconds, from its usage.

Targets (the issue's): B's queue wait p99 at most the slot-free time's p99 with the fair share on; the weights'
output tokens within 10% of 3:1.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Services, http_client, ms, pct, table, write_json  # noqa: E402
from chatq.core import keys  # noqa: E402

KEY_A, KEY_B, ADMIN = "bench-key-a-0123456789", "bench-key-b-0123456789", "bench-admin-0123456789"
M = [{"role": "user", "content": "Count to ten."}]


def body(max_tokens: int) -> dict[str, Any]:
    return {"messages": M, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "background": True}


async def submit(http: httpx.AsyncClient, base: str, key: str, max_tokens: int) -> str:
    r = await http.post(
        f"{base}/v1/chat/completions", json=body(max_tokens), headers={"Authorization": f"Bearer {key}"}
    )
    r.raise_for_status()
    return r.json()["id"]


async def job(http: httpx.AsyncClient, base: str, key: str, job_id: str) -> dict[str, Any]:
    for _ in range(3):  # a kept-alive connection the server closed meanwhile: read again on a new one
        try:
            r = await http.get(f"{base}/v1/chat/completions/{job_id}", headers={"Authorization": f"Bearer {key}"})
            return r.json()
        except httpx.TransportError:
            await asyncio.sleep(0.1)
    return {"id": job_id, "status": "queued"}


async def wait_side(svc: Services, args: argparse.Namespace) -> dict[str, float]:
    """B's queue waits (claim minus submit, from the job records) while A's flood runs, and for each of B's jobs the
    time the worker needed to free a slot after it came: the first of A's jobs to finish after B's submit."""
    r = redis.Redis.from_url(svc.settings.redis_url, decode_responses=True)
    async with http_client() as http:
        base = svc.base_url
        flood = await asyncio.gather(*(submit(http, base, KEY_A, 8) for _ in range(args.flood)))
        start = time.monotonic()
        ours = []
        while time.monotonic() - start < args.duration:
            ours.append(await submit(http, base, KEY_B, 8))
            await asyncio.sleep(args.every)
        submitted = []
        for job_id in ours:
            while not (times := r.hmget(keys.job(job_id), "submitted", "started"))[1]:
                await asyncio.sleep(0.5)
            submitted.append((float(times[0] or 0), float(times[1])))
        finished = sorted(float(f) for j in flood if (f := r.hget(keys.job(j), "finished")))
    r.close()
    waits = [started - sent for sent, started in submitted]
    # A slot that frees before B's job is dispatched goes to it: the next finish after B's submit.
    slot = [next((f for f in finished if f > sent), math.inf) - sent for sent, _ in submitted]
    return {
        "b_wait_p50": pct(waits, 50),
        "b_wait_p99": pct(waits, 99),
        "slot_free_p50": pct(slot, 50),
        "slot_free_p99": pct(slot, 99),
        "b_jobs": len(waits),
    }


async def weights_side(base: str, args: argparse.Namespace) -> dict[str, float]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with http_client() as http:
        made = {}
        for name, weight in (("heavy", 3), ("light", 1)):
            r = await http.post(f"{base}/v1/admin/keys", json={"name": name, "weight": weight}, headers=admin)
            r.raise_for_status()
            made[name] = r.json()["value"]

        async def keep_busy(key: str, stop: asyncio.Event) -> None:
            """Keeps --backlog of the key's jobs queued, so the key never runs out of work to be dispatched."""
            pending: set[str] = set()
            while not stop.is_set():
                pending |= set(
                    await asyncio.gather(*(submit(http, base, key, 16) for _ in range(args.backlog - len(pending))))
                )
                seen = await asyncio.gather(*(job(http, base, key, j) for j in pending))
                pending = {s["id"] for s in seen if s["status"] == "queued"}
                await asyncio.sleep(0.25)

        async def output(name: str) -> int:
            r = await http.get(f"{base}/v1/admin/keys/{name}/usage", params={"days": 2}, headers=admin)
            return sum(row["output_tokens"] for row in r.json()["data"])

        stop = asyncio.Event()
        busy = [asyncio.create_task(keep_busy(made[n], stop)) for n in made]
        await asyncio.sleep(10)  # both backlogs built up
        before = {n: await output(n) for n in made}
        await asyncio.sleep(args.window)
        after = {n: await output(n) for n in made}
        stop.set()
        await asyncio.gather(*busy)
    served = {n: after[n] - before[n] for n in made}
    return {
        "heavy_tokens": served["heavy"],
        "light_tokens": served["light"],
        "ratio": served["heavy"] / served["light"],
    }


def stack(args: argparse.Namespace, fair: bool) -> Services:
    env = {"CHATQ_API_KEYS": f"{KEY_A},{KEY_B}", "CHATQ_ADMIN_KEY": ADMIN, "CHATQ_FAIR_SHARE": str(fair).lower()}
    env["CHATQ_MAX_QUEUED"] = str(10 * args.flood)
    return Services(args.slots, extra_env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8, help="the worker's CHATQ_WORKER_CONCURRENCY")
    parser.add_argument("--flood", type=int, default=2000)
    parser.add_argument("--every", type=float, default=2.0)
    parser.add_argument("--for", dest="duration", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--backlog", type=int, default=64, help="jobs each key keeps queued in the weights part")
    parser.add_argument("--out")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for fair in (True, False):
        with stack(args, fair) as svc:
            if fair:
                results["weights"] = asyncio.run(weights_side(svc.base_url, args))
            results["fair" if fair else "fifo"] = asyncio.run(wait_side(svc, args))
        print(results, flush=True)
    rows = [
        [side, results[side]["b_jobs"]]
        + [ms(results[side][f"{what}_{q}"]) for what in ("b_wait", "slot_free") for q in ("p50", "p99")]
        for side in ("fair", "fifo")
    ]
    heads = ["side", "B jobs", "B wait p50 ms", "B wait p99 ms", "slot free p50 ms", "slot free p99 ms"]
    print(table(heads, rows))
    w = results["weights"]
    print(f"weights 3:1: output tokens {w['heavy_tokens']} / {w['light_tokens']} = {w['ratio']:.2f}")
    fair_met = results["fair"]["b_wait_p99"] <= results["fair"]["slot_free_p99"]
    print(f"B's p99 wait within one slot's time (fair): {'MET' if fair_met else 'NOT MET'}")
    print(f"weights within 10% of 3: {'MET' if abs(w['ratio'] - 3) <= 0.3 else 'NOT MET'}")
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
