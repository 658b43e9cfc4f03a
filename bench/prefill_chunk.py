"""What CHATQ_PREFILL_CHUNK trades on this machine: the gap running streams see while a long prompt comes in, against
the long prompt's own prefill time and a burst's throughput.

Run from the repository root:

    .venv/bin/python bench/prefill_chunk.py [--chunks 512,256,128,64] [--runs 3] [--dtype float32] [--prompt 4000]

The engine alone, per chunk size, the sizes interleaved within each run:

- long prompt: 8 sequences decode; once their steps are steady, a prompt of --prompt tokens joins. The columns are
  the decode step before it, the median and largest step while it is prefilled (the gap each stream sees between
  two tokens), and the time until its first token;
- burst: 32 prompts of 40 tokens at once, 64 new tokens each, greedy: output tokens/s until the last ends.

Each cell is the median of the runs, with their min-max spread.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table  # noqa: E402
from chatq.core.settings import Settings  # noqa: E402
from chatq.worker.engine import Engine, Sequence  # noqa: E402
from chatq.worker.model import load_model  # noqa: E402
from chatq.worker.sampler import SamplingParams  # noqa: E402

FOREVER = SamplingParams(max_tokens=10**6, temperature=0)


def long_prompt(model: object, chunk: int, prompt: int) -> tuple[float, float, float, float]:
    """The decode step alone, the median and largest step while the prompt is prefilled, and its prefill time."""
    engine = Engine(model, kv_tokens=16384, block_size=16, prefill_chunk=chunk, max_model_len=8192)
    for i in range(8):
        engine.add(Sequence(f"d{i}", list(range(100, 140)), FOREVER))
    for _ in range(5):
        engine.step()
    start = time.perf_counter()
    for _ in range(5):
        engine.step()
    decode = (time.perf_counter() - start) / 5
    engine.add(Sequence("long", [100 + i % 5000 for i in range(prompt)], SamplingParams(max_tokens=1, temperature=0)))
    steps, start = [], time.perf_counter()
    while True:
        t = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        if any(o.seq.id == "long" and o.finish is not None for o in outputs):
            return decode, statistics.median(steps), max(steps), time.perf_counter() - start


def burst(model: object, chunk: int, seed: int) -> float:
    engine = Engine(model, kv_tokens=16384, block_size=16, prefill_chunk=chunk, max_model_len=8192)
    rng = random.Random(seed)
    for i in range(32):
        ids = [rng.randrange(100, 5000) for _ in range(40)]
        engine.add(Sequence(f"s{i}", ids, SamplingParams(max_tokens=64, temperature=0)))
    start, done = time.perf_counter(), 0
    while done < 32:
        done += sum(1 for o in engine.step() if o.finish is not None)
    return 32 * 64 / (time.perf_counter() - start)


def cell(values: list[float], scale: float = 1.0) -> str:
    scaled = sorted(v * scale for v in values)
    return f"{statistics.median(scaled):.0f} ({scaled[0]:.0f}-{scaled[-1]:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[512, 256, 128, 64])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt", type=int, default=4000)
    args = parser.parse_args()
    model = load_model(Settings(dtype=args.dtype))
    seen: dict[int, list[tuple[float, ...]]] = {c: [] for c in args.chunks}
    for run in range(args.runs):
        for chunk in args.chunks:
            seen[chunk].append((*long_prompt(model, chunk, args.prompt), burst(model, chunk, run)))
    rows = []
    for chunk, runs in seen.items():
        decode, median, most, prefill, rate = (list(column) for column in zip(*runs, strict=True))
        rows.append([chunk, cell(decode, 1e3), cell(median, 1e3), cell(most, 1e3), cell(prefill, 1e3), cell(rate)])
    headers = ["chunk", "decode step ms", "step while prefilling ms", "largest ms", "prefill ms", "burst tok/s"]
    print(f"{args.dtype}, 8 streams and a {args.prompt}-token prompt; a burst of 32x64; {args.runs} runs")
    print(table(headers, rows))


if __name__ == "__main__":
    main()
