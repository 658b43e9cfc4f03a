"""What partitioning the prefix cache by API key costs: the prefix cache's hit rate and the time to first token of
requests that share one long system prompt, with the cache partitioned by key (the default) and shared across keys
(CHATQ_SHARE_PREFIX_CACHE=true).

Run from the repository root:

    .venv/bin/python bench/prefix_partition.py [--keys 4] [--repeats 3] [--runs 3] [--system 1000]

The engine alone, on the default model in float32 on the CPU, each sequence salted as the API salts a job of its key
(chatq.core.job.cache_partition). Each run takes each mode in turn (the order alternating between runs) with a system
prompt of about --system tokens that no earlier request used: every key sends --repeats questions after its first,
one at a time, the keys taking turns. The columns are the share of prompt tokens the cache served (a job's
usage.prompt_tokens_details.cached_tokens), and the median time to first token of a key's first request and of its
repeats. Each cell is the median of the runs, with their min-max spread.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table  # noqa: E402
from chatq.core.job import cache_partition  # noqa: E402
from chatq.core.settings import Settings  # noqa: E402
from chatq.worker.engine import Engine, Sequence  # noqa: E402
from chatq.worker.model import load_model  # noqa: E402
from chatq.worker.sampler import SamplingParams  # noqa: E402

MODES = {"partitioned": False, "shared": True}


def first_token(engine: Engine, seq: Sequence) -> float:
    """Seconds from the sequence's arrival to its first token; it is then run to its end."""
    start = time.perf_counter()
    engine.add(seq)
    ttft = None
    while engine.has_work():
        outputs = engine.step()
        if ttft is None and any(o.seq is seq for o in outputs):
            ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft


def one_mode(engine: Engine, owners: list[str], shared: bool, repeats: int, system: int) -> tuple[float, float, float]:
    """Hit rate, median TTFT of each key's first request and of its repeats, under a system prompt new to the cache."""
    rng = random.Random()
    prefix = [rng.randrange(100, 40000) for _ in range(system)]
    firsts, later, prompt, cached = [], [], 0, 0
    for i in range(repeats + 1):
        for k, owner in enumerate(owners):
            question = [rng.randrange(100, 40000) for _ in range(12)]
            salt = bytes.fromhex(cache_partition(owner, None, shared))
            seq = Sequence(f"{k}/{i}", prefix + question, SamplingParams(max_tokens=2, temperature=0), cache_salt=salt)
            (firsts if i == 0 else later).append(first_token(engine, seq))
            prompt += len(seq.prompt_ids)
            cached += seq.cached_prompt_tokens or 0
    return cached / prompt, statistics.median(firsts), statistics.median(later)


def cell(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="requests per key after its first")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--system", type=int, default=1000, help="system prompt tokens")
    args = ap.parse_args()
    owners = [hashlib.sha256(f"bench-key-{i}".encode()).hexdigest() for i in range(args.keys)]
    model = load_model(Settings(device="cpu", dtype="float32"))
    engine = Engine(model, kv_tokens=65536, block_size=16, prefill_chunk=256, max_model_len=8192)
    results: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
    for run in range(args.runs):
        order = list(MODES) if run % 2 == 0 else list(reversed(MODES))
        for mode in order:
            results[mode].append(one_mode(engine, owners, MODES[mode], args.repeats, args.system))
    rows = [
        [
            mode,
            cell([r[0] * 100 for r in runs], "{:.1f}%"),
            cell([r[1] * 1000 for r in runs], "{:.0f}"),
            cell([r[2] * 1000 for r in runs], "{:.0f}"),
        ]
        for mode, runs in results.items()
    ]
    print(f"{args.keys} keys, {args.repeats} repeats each, a system prompt of {args.system} tokens")
    print(table(["prefix cache", "hit rate", "TTFT first of a key, ms", "TTFT repeat, ms"], rows))


if __name__ == "__main__":
    main()
