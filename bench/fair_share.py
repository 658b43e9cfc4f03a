"""The fair share of one worker between API keys, on the real stack (one CPU worker of the default model).

Run from the repository root:

    .venv/bin/python bench/fair_share.py [--slots 8] [--flood 2000] [--every 2] [--for 60] [--window 60]
                                         [--out results.json]

1. **wait**: key A submits --flood background jobs at once (max_tokens 8, greedy, ignore_eos); key B then submits one
   background job every --every seconds for --for seconds. B's queue wait is its job's claim minus its submit; the
   time the worker needs to free one slot is the mean gap between two of A's jobs ending, in the same run. Run once
   with the fair share on and once off (CHATQ_FAIR_SHARE=false: first come first served).
2. **weights**: two managed keys of weights 3 and 1 keep --slots x 2 background jobs each queued (max_tokens 16);
   after a warm-up, the output tokens each is served over --window seconds, from its usage.

Targets (the issue's): B's queue wait p99 at most the time to free one slot with the fair share on; the weights'
output tokens within 10% of 3:1.
"""

from __future__ import annotations

import argparse
import asyncio
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
    r = await http.get(f"{base}/v1/chat/completions/{job_id}", headers={"Authorization": f"Bearer {key}"})
    return r.json()


async def wait_side(svc: Services, args: argparse.Namespace) -> dict[str, float]:
    """B's queue waits (claim minus submit, from the job records) while A's flood runs, and the time the worker took
    to free a slot meanwhile."""
    r = redis.Redis.from_url(svc.settings.redis_url, decode_responses=True)
    async with http_client() as http:
        base = svc.base_url
        flood = await asyncio.gather(*(submit(http, base, KEY_A, 8) for _ in range(args.flood)))
        start = time.monotonic()
        ours = []
        while time.monotonic() - start < args.duration:
            ours.append(await submit(http, base, KEY_B, 8))
            await asyncio.sleep(args.every)
        waits = []
        for job_id in ours:
            while not (times := r.hmget(keys.job(job_id), "submitted", "started"))[1]:
                await asyncio.sleep(0.5)
            waits.append(float(times[1]) - float(times[0] or 0))
        ended = sum(r.hget(keys.job(j), "status") == "completed" for j in flood)
        slot = (time.monotonic() - start) / max(1, ended)
    r.close()
    return {"b_wait_p50": pct(waits, 50), "b_wait_p99": pct(waits, 99), "slot_free_s": slot, "b_jobs": len(waits)}


async def weights_side(base: str, args: argparse.Namespace) -> dict[str, float]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with http_client() as http:
        made = {}
        for name, weight in (("heavy", 3), ("light", 1)):
            r = await http.post(f"{base}/v1/admin/keys", json={"name": name, "weight": weight}, headers=admin)
            r.raise_for_status()
            made[name] = r.json()["value"]

        async def keep_busy(key: str, stop: asyncio.Event) -> None:
            pending: set[str] = set()
            while not stop.is_set():
                while len(pending) < args.slots * 2:
                    pending.add(await submit(http, base, key, 16))
                for job_id in list(pending):
                    if (await job(http, base, key, job_id))["status"] != "queued":
                        pending.discard(job_id)
                await asyncio.sleep(1.0)

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
        [side, results[side]["b_jobs"], ms(results[side]["b_wait_p50"]), ms(results[side]["b_wait_p99"])]
        + [ms(results[side]["slot_free_s"])]
        for side in ("fair", "fifo")
    ]
    print(table(["side", "B jobs", "B wait p50 ms", "B wait p99 ms", "slot frees every ms"], rows))
    w = results["weights"]
    print(f"weights 3:1: output tokens {w['heavy_tokens']} / {w['light_tokens']} = {w['ratio']:.2f}")
    fair_met = results["fair"]["b_wait_p99"] <= results["fair"]["slot_free_s"]
    print(f"B's p99 wait within one slot's time (fair): {'MET' if fair_met else 'NOT MET'}")
    print(f"weights within 10% of 3: {'MET' if abs(w['ratio'] - 3) <= 0.3 else 'NOT MET'}")
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
