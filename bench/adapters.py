"""LoRA adapters against the model alone, on the real stack (one worker of the default model, on this machine's CPU or
GPU).

Run from the repository root:

    .venv/bin/python bench/adapters.py [--streams 32] [--adapters 4] [--rank 16] [--tokens 128] [--rounds 3]
                                       [--out results.json]

1. **throughput**: in each round, --streams streams of the model alone and --streams streams spread evenly over
   --adapters adapters of rank --rank (named at the worker's start), one after the other, in alternating order:
   output tokens per second from the first request to the last answer (greedy, ignore_eos, --tokens each).
2. **load pause**: while --streams streams of the model run, a request of an adapter already resident arrives; then
   an adapter is loaded through /v1/load_lora_adapter and a request made with it (the worker reads it then and swaps
   it in). For each, the running streams' longest gap between two tokens from the request (the load) to its first
   token, against their median gap before both (one decode step); a request's arrival alone adds its prompt's
   prefill to a step.

Targets (the issue's): the adapters' output tokens/s at least 0.8x the model's alone; a load pausing the streams by at
most one decode step: its longest gap at most one step longer than a resident adapter's request's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Services, StreamResult, http_client, ms, pct, stream_chat, table, write_json  # noqa: E402
from tests.helpers import make_adapter  # noqa: E402

M = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def body(model: str, tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": M, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}


async def streams(base: str, models: list[str], tokens: int) -> list[StreamResult]:
    async with http_client() as http:
        return await asyncio.gather(
            *(stream_chat(http, f"{base}/v1/chat/completions", body(m, tokens)) for m in models)
        )


def rate(results: list[StreamResult]) -> float:
    errors = [r.error for r in results if r.error]
    assert not errors, errors[:3]
    return sum(r.completion_tokens for r in results) / (max(r.end for r in results) - min(r.start for r in results))


async def throughput(base: str, model: str, names: list[str], args: argparse.Namespace, flip: bool) -> dict[str, float]:
    spread = [names[i % len(names)] for i in range(args.streams)]
    sides = [("base", [model] * args.streams), ("adapters", spread)]
    out = {}
    for side, models in reversed(sides) if flip else sides:
        out[side] = rate(await streams(base, models, args.tokens))
    return out | {"ratio": out["adapters"] / out["base"]}


async def arrival(http: httpx.AsyncClient, base: str, model: str, load: Path | None) -> tuple[float, float]:
    """A request for `model` made while streams run, after loading it from `load` if given: when it was asked for
    (the load's start) and when its first token came."""
    asked = time.time()
    if load is not None:
        r = await http.post(f"{base}/v1/load_lora_adapter", json={"lora_name": model, "lora_path": str(load)})
        r.raise_for_status()
    while True:  # a loaded adapter is known to the API within its registry's refresh
        got = await stream_chat(http, f"{base}/v1/chat/completions", body(model, 4))
        if not got.error:
            return asked, got.token_times[0]
        await asyncio.sleep(0.1)


async def load_pause(base: str, model: str, names: list[str], root: Path, args: argparse.Namespace) -> dict[str, float]:
    """The running streams' longest gap while a request of a resident adapter arrives, then while one of an adapter
    loaded for it does, each against their median gap before both (one decode step)."""
    path = make_adapter(root / "loaded", rank=args.rank, seed=99)
    async with http_client() as http:
        running = asyncio.ensure_future(streams(base, [model] * args.streams, 4 * args.tokens))
        await asyncio.sleep(8)  # every stream past its prompt
        plain = await arrival(http, base, names[0], None)
        await asyncio.sleep(2)
        loaded = await arrival(http, base, "loaded", path)
        results = await running
    gaps = [(at, gap) for r in results for at, gap in zip(r.token_times[1:], r.itls, strict=True)]
    step = statistics.median(gap for at, gap in gaps if at < plain[0])

    def longest(window: tuple[float, float]) -> float:
        return max(gap for at, gap in gaps if window[0] <= at <= window[1] + step)

    return {"step": step, "plain": longest(plain), "load": longest(loaded), "window": loaded[1] - loaded[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="chatq-adapters-"))
    names = [f"adapter{i}" for i in range(args.adapters)]
    modules = ",".join(f"{n}={make_adapter(root / n, rank=args.rank, seed=i)}" for i, n in enumerate(names))
    env = {
        "CHATQ_LORA_MODULES": modules,
        "CHATQ_MAX_LORAS": str(args.adapters),
        "CHATQ_MAX_LORA_RANK": str(args.rank),
        "CHATQ_ALLOW_RUNTIME_LORA_UPDATING": "true",
    }
    with Services(2 * args.streams, extra_env=env) as svc:
        model = svc.settings.model_name
        asyncio.run(streams(svc.base_url, [model, *names], 8))  # warm-up: every adapter read and swapped in once
        rounds = [
            asyncio.run(throughput(svc.base_url, model, names, args, flip=i % 2 == 1)) for i in range(args.rounds)
        ]
        pause = asyncio.run(load_pause(svc.base_url, model, names, root, args))
    rows = [[i + 1, f"{r['base']:.1f}", f"{r['adapters']:.1f}", f"{r['ratio']:.3f}"] for i, r in enumerate(rounds)]
    print(table(["round", "model alone tok/s", f"{args.adapters} adapters tok/s", "ratio"], rows))
    ratios = [r["ratio"] for r in rounds]
    print(f"ratio min / median / max: {min(ratios):.3f} / {pct(ratios, 50):.3f} / {max(ratios):.3f}")
    step = pause["step"]
    rows = [
        ["a resident adapter's request", ms(pause["plain"]), f"{pause['plain'] / step:.2f}"],
        ["a load, then its request", ms(pause["load"]), f"{pause['load'] / step:.2f}"],
    ]
    print(f"\nrunning streams' longest gap (a decode step: {ms(step)} ms; load to first token {pause['window']:.2f} s)")
    print(table(["while", "longest gap ms", "steps"], rows))
    added = (pause["load"] - pause["plain"]) / step
    print(f"adapters at least 0.8x the model alone: {'MET' if min(ratios) >= 0.8 else 'NOT MET'}")
    print(
        f"a load adds {added:.2f} steps to an arrival's longest gap, at most one: {'MET' if added <= 1 else 'NOT MET'}"
    )
    write_json(args.out, {"args": vars(args), "rounds": rounds, "pause": pause})


if __name__ == "__main__":
    main()
