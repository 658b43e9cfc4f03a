"""What a managed key's rate limits add to a request: the same requests under a key without limits and under one
with requests and tokens per minute (too high to refuse any), interleaved, through the whole stack with the
zero-cost generator (bench/zero_worker.py), so the difference is the limits' own cost.

Run from the repository root:

    .venv/bin/python bench/rate_limits.py [--rounds 3] [--rate 100] [--duration 10] [--out results.json]

Each round sends --rate non-streamed requests (max_tokens 1) a second for --duration seconds under each key, the
order alternating between rounds. Target (the issue's): the limits add at most 1 ms to the p50.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Services, ms, pct, table, write_json  # noqa: E402
from bench.queue_overhead import body, open_loop  # noqa: E402

PLAIN, ADMIN = "bench-plain-key-0123456789", "bench-admin-key-0123456789"


def limited_key(base: str) -> str:
    made = httpx.post(
        f"{base}/v1/admin/keys",
        json={"name": "bench-limited", "rpm": 10**8, "tpm": 10**10},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    made.raise_for_status()
    return made.json()["value"]


def phase(svc: Services, key: str, args: argparse.Namespace) -> dict[str, Any]:
    url = f"{svc.base_url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}
    samples, _ = uvloop.run(
        open_loop(url, body(svc.settings.model_name, "non-streamed", 1), args.rate, args.duration, headers)
    )
    ok = [s.recv - s.send for s in samples if s.error is None]
    if len(ok) != len(samples):
        raise RuntimeError(f"{len(samples) - len(ok)} requests failed: {[s.error for s in samples if s.error][:3]}")
    return {"p50": pct(ok, 50), "p99": pct(ok, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100)
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    env = {"CHATQ_API_KEYS": PLAIN, "CHATQ_ADMIN_KEY": ADMIN}
    rows = []
    with Services(64, worker_app="bench.zero_worker", device="cpu", extra_env=env) as svc:
        keys = {"plain": PLAIN, "limited": limited_key(svc.base_url)}
        for side in keys.values():  # unmeasured: the first requests of each key
            phase(svc, side, argparse.Namespace(rate=args.rate, duration=2))
        for n in range(args.rounds):
            order = ["plain", "limited"] if n % 2 == 0 else ["limited", "plain"]
            got = {side: phase(svc, keys[side], args) for side in order}
            rows.append({"round": n} | {f"{side}_{q}": got[side][q] for side in keys for q in ("p50", "p99")})
            print(f"round {n}: {rows[-1]}", flush=True)
    print(
        table(
            ["round", "plain p50 / p99 ms", "limited p50 / p99 ms", "added p50 ms"],
            [
                [
                    r["round"],
                    f"{ms(r['plain_p50'])} / {ms(r['plain_p99'])}",
                    f"{ms(r['limited_p50'])} / {ms(r['limited_p99'])}",
                    ms(r["limited_p50"] - r["plain_p50"]),
                ]
                for r in rows
            ],
        )
    )
    added = [r["limited_p50"] - r["plain_p50"] for r in rows]
    met = statistics.median(added) <= 0.001
    spread = f"{ms(min(added))}-{ms(max(added))} ms, median {ms(statistics.median(added))}"
    print(f"added p50: {spread} (target at most 1 ms): {'MET' if met else 'NOT MET'}")
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
