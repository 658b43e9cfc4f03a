"""How long a stream waits when its worker dies or stops: SIGKILL, SIGTERM (after the grace period), two SIGTERMs.

Run from the repository root:

    .venv/bin/python bench/recovery.py [--runs 3] [--worker-ttl 15] [--stop-grace 30] [--tokens 300]

Two workers of the default model and an API on an embedded Redis, at the given CHATQ_WORKER_TTL and
CHATQ_STOP_GRACE. For each fault, a greedy streamed request of --tokens tokens; once 20 events arrived its worker
gets the signal (and another worker is started). Printed per fault: the longest wait between two events of the
stream (the gap the fault caused), whether the stream was whole (every sequence number once, `done` last), and
whether its text equals the same request's uninterrupted answer.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Services, pct, table  # noqa: E402
from chatq.core import keys  # noqa: E402

FAULTS = {"SIGKILL": (signal.SIGKILL,), "SIGTERM": (signal.SIGTERM,), "SIGTERM x2": (signal.SIGTERM, signal.SIGTERM)}
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


def body(tokens: int, stream: bool) -> dict:
    return {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


def holder(r: redis.Redis, job_id: str) -> str:
    while not (worker := r.hget(keys.job(job_id), "worker")):
        time.sleep(0.01)
    return worker.split("@")[0]


def one_fault(svc: Services, r: redis.Redis, sigs: tuple[int, ...], tokens: int) -> tuple[float, bool, str]:
    """The longest gap between two events, whether the stream was whole, and its text."""
    ids, text, times = [], [], []
    with httpx.stream("POST", f"{svc.base_url}/v1/chat/completions", json=body(tokens, True), timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("id:"):
                ids.append(int(line[3:]))
                times.append(time.time())
            elif line.startswith("data: {"):
                chunk = json.loads(line[5:])
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
                if len(ids) == 20:
                    victim = next(p for p in svc.procs if p.name == holder(r, chunk["id"]))
                    for sig in sigs:
                        victim.popen.send_signal(sig)
                        time.sleep(0.1)
                    svc.add_worker()
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    return gap, ids == list(range(1, len(ids) + 1)), "".join(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worker-ttl", type=int, default=15)
    ap.add_argument("--stop-grace", type=float, default=30)
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args(argv)
    env = {"CHATQ_WORKER_TTL": str(args.worker_ttl), "CHATQ_STOP_GRACE": str(args.stop_grace)}
    rows = []
    with Services(worker_concurrency=8, workers=2, extra_env=env) as svc:
        r = redis.Redis.from_url(svc.settings.redis_url, decode_responses=True)
        expected = httpx.post(f"{svc.base_url}/v1/chat/completions", json=body(args.tokens, False), timeout=300)
        answer = expected.json()["choices"][0]["message"]["content"]
        results: dict[str, list[tuple[float, bool, str]]] = {f: [] for f in FAULTS}
        for _ in range(args.runs):  # interleaved: each run meets every fault once
            for fault, sigs in FAULTS.items():
                results[fault].append(one_fault(svc, r, sigs, args.tokens))
                time.sleep(args.worker_ttl)  # the replacement worker registers before the next fault
        for fault, runs in results.items():
            gaps = [g for g, _, _ in runs]
            whole = sum(w for _, w, _ in runs)
            same = sum(t == answer for _, _, t in runs)
            spread = f"{min(gaps):.1f} / {pct(gaps, 50):.1f} / {max(gaps):.1f}"
            rows.append([fault, spread, f"{whole}/{len(runs)}", f"{same}/{len(runs)}"])
    print(f"CHATQ_WORKER_TTL={args.worker_ttl} s, CHATQ_STOP_GRACE={args.stop_grace} s, {args.tokens} tokens")
    print(table(["fault", "stream gap s (min / p50 / max)", "whole", "same text"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
