"""Throughput and latency of chatq through the whole stack (HTTP -> Redis -> worker -> Redis -> SSE), beside
`transformers serve --continuous-batching` (twice: sized for the machine, and at its defaults) and plain HF `generate`
(batch 1), on the same model, dtype and load.

Run from the repository root (the script puts the root on sys.path; `python -m bench.stack` works too):

    .venv/bin/python bench/stack.py [--runs 3] [--concurrency 1,32,64] [--requests-per-stream 2] [--max-tokens 64]
                                    [--dtype float32] [--cb-num-blocks 512] [--cb-block-size 32]
                                    [--cb-max-batch-tokens 1024] [--no-baselines] [--device cpu] [--threads N]
                                    [--model-dir DIR] [--out results.json] [--keep-logs]

Rounds: --runs rounds, each starting every system in turn, alone (so they never share the CPU): chatq, `serve
(sized)` (`--cb-num-blocks/--cb-block-size/--cb-max-batch-tokens` as given), `serve (defaults)` (no --cb-* flags),
then HF generate; so the systems alternate and drift on the machine hits them all alike. --no-baselines runs chatq
alone. Each start is warmed up with one request, measured at every concurrency level, and stopped. The dtype goes to
chatq's worker as CHATQ_DTYPE, to serve as --dtype and to HF generate ("auto": each system's own default).

Load: at concurrency c, c client streams each send --requests-per-stream streamed requests one after another
(closed loop), cycling through the same prompts ("Write a very long story about ..."), temperature 0, max_tokens
fixed, stream_options.include_usage. Both servers get the same body; chatq also gets `ignore_eos: true` when its API
accepts it (probed at each start; a 400 means not yet). Token counts are always taken from the usage chunk.

Columns: aggregate output tokens/s = all completion tokens / wall time of the level; TTFT = time to the first chunk
with non-empty content; ITL = gaps between consecutive content chunks of a request; for HF generate both come from
a streamer's token callbacks. Ratios of aggregate tok/s are taken within a round (chatq of round k against serve of
round k), listed per round with their min-max spread and median. Targets (from the issue): chatq at 32 and at 64
streams >= 2x serve (sized) at the same dtype, and chatq at 32 streams >= 10x chatq at 1 stream; a target is MET when
the minimum across rounds reaches it. Reported, not tuned here.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    Proc,
    Services,
    StreamResult,
    http_client,
    ms,
    pct,
    stream_chat,
    table,
    wait_healthy,
    write_json,
)
from chatq.core.settings import Settings  # noqa: E402
from chatq.embedded_redis import free_port  # noqa: E402

TOPICS = [
    "a dragon who learns to paint",
    "a lighthouse keeper on a distant planet",
    "two rival chefs in an old city",
    "a robot that collects forgotten maps",
    "a river that flows backwards",
    "a detective cat in a floating town",
    "the last library on Earth",
    "a musician lost in a desert",
]
PROMPTS = [f"Write a very long story about {t}. Describe every character and every place in detail." for t in TOPICS]
CHATQ, SERVE_SIZED, SERVE_DEFAULTS, HF_GENERATE = "chatq", "serve (sized)", "serve (defaults)", "hf-generate (batch 1)"
# (ratio key, target): chatq against serve (sized) at 32 and 64 streams, and chatq's own scaling from 1 to 32 streams.
TARGETS = [
    (f"{CHATQ}@32 / {SERVE_SIZED}@32", 2.0),
    (f"{CHATQ}@64 / {SERVE_SIZED}@64", 2.0),
    (f"{CHATQ}@32 / {CHATQ}@1", 10.0),
]


@dataclass
class Row:
    run: int
    system: str
    concurrency: int
    requests: int
    errors: int
    tokens: int
    wall_s: float
    tok_s: float
    tokens_per_request: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float


@dataclass
class Outcome:
    """What all rounds produced: the rows, chatq's ignore_eos per start, and the starts that failed."""

    rows: list[Row] = field(default_factory=list)
    ignore_eos: list[bool] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def make_row(run: int, system: str, concurrency: int, results: list[StreamResult], wall: float) -> Row:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    itls = [g for r in ok for g in r.itls]
    return Row(
        run,
        system,
        concurrency,
        len(results),
        len(results) - len(ok),
        tokens,
        wall,
        tokens / wall if wall > 0 else 0.0,
        tokens / len(ok) if ok else 0.0,
        pct(ttfts, 50),
        pct(ttfts, 99),
        pct(itls, 50),
        pct(itls, 99),
    )


# --- load -----------------------------------------------------------------------------------------------


def body(model: str, prompt: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        **extra,
    }


async def run_level(
    url: str, make_body: Callable[[int], dict[str, Any]], concurrency: int, per_stream: int
) -> tuple[list[StreamResult], float]:
    counter = itertools.count()
    async with http_client() as client:

        async def one_stream() -> list[StreamResult]:
            return [await stream_chat(client, url, make_body(next(counter))) for _ in range(per_stream)]

        start = time.time()
        groups = await asyncio.gather(*(one_stream() for _ in range(concurrency)))
        wall = time.time() - start
    return [r for g in groups for r in g], wall


async def measure(
    run: int, system: str, url: str, make_body: Callable[[int], dict[str, Any]], args: argparse.Namespace
) -> list[Row]:
    warm, _ = await run_level(url, make_body, 1, 1)
    if warm[0].error:
        raise RuntimeError(f"{system}: warm-up request failed: {warm[0].error}")
    rows = []
    for c in args.concurrency:
        results, wall = await run_level(url, make_body, c, args.requests_per_stream)
        row = make_row(run, system, c, results, wall)
        errors = {r.error for r in results if r.error}
        print(f"  {system} @{c}: {row.tok_s:.1f} tok/s" + (f", errors: {sorted(errors)[:3]}" if errors else ""))
        rows.append(row)
    return rows


# --- the systems ----------------------------------------------------------------------------------------


def ignore_eos_accepted(base: str, model: str) -> bool:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "ignore_eos": True},
        timeout=300,
    )
    if r.status_code not in (200, 400):
        raise RuntimeError(f"ignore_eos probe: unexpected HTTP {r.status_code}: {r.text[:300]}")
    return r.status_code == 200


def thread_env(args: argparse.Namespace) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}


def bench_chatq(args: argparse.Namespace, run: int) -> tuple[list[Row], bool]:
    env = thread_env(args) | {"CHATQ_DTYPE": args.dtype}
    # The product default (64) unless a level needs more jobs at once than that.
    with Services(max(64, *args.concurrency), device=args.device, keep_logs=args.keep_logs, extra_env=env) as svc:
        name = svc.settings.model_name
        use_ignore_eos = ignore_eos_accepted(svc.base_url, name)
        extra = {"ignore_eos": True} if use_ignore_eos else {}
        print(f"  chatq: ignore_eos {'accepted' if use_ignore_eos else 'refused (400): long-story prompts only'}")
        url = f"{svc.base_url}/v1/chat/completions"

        def make_body(i: int) -> dict[str, Any]:
            return body(name, PROMPTS[i % len(PROMPTS)], args.max_tokens, extra)

        rows = asyncio.run(measure(run, CHATQ, url, make_body, args))
    return rows, use_ignore_eos


def serve_command(args: argparse.Namespace, port: int, sized: bool) -> list[str]:
    command = [str(Path(sys.executable).parent / "transformers"), "serve", "--continuous-batching"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--dtype", args.dtype]
    if sized:
        command += ["--cb-num-blocks", str(args.cb_num_blocks), "--cb-block-size", str(args.cb_block_size)]
        command += ["--cb-max-batch-tokens", str(args.cb_max_batch_tokens)]
    return command + ["--log-level", "warning", str(args.model_dir)]


def bench_serve(args: argparse.Namespace, run: int, sized: bool) -> list[Row]:
    system = SERVE_SIZED if sized else SERVE_DEFAULTS
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="chatq-bench-tserve-"))
    proc = Proc("transformers-serve", serve_command(args, port, sized), dict(os.environ) | thread_env(args), log_dir)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [proc])
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        model = str(args.model_dir)  # the server is pinned to it (FORCE_MODEL); other names are a 400

        def make_body(i: int) -> dict[str, Any]:
            return body(model, PROMPTS[i % len(PROMPTS)], args.max_tokens, {})

        return asyncio.run(measure(run, system, url, make_body, args))
    finally:
        proc.stop()
        if args.keep_logs:
            print(f"  {system} log kept in {proc.log_path}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)


def token_clock() -> Any:
    """A generate() streamer that records the arrival time of each new token (the first put carries the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value: Any) -> None:
            if self.prompt_seen:
                self.times.append(time.time())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    return Clock()


def load_hf(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model, tokenizer, device), on the device and dtype chatq's worker would pick for the same flags."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(args.model_dir), device


def hf_generate_one(model: Any, tokenizer: Any, device: Any, prompt: str, n: int) -> StreamResult:
    """One greedy `generate` of exactly n new tokens (min_new_tokens), timed per token."""
    import torch

    encoded: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = encoded["input_ids"].to(device)
    clock = token_clock()
    res = StreamResult(start=time.time())
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            streamer=clock,
            pad_token_id=tokenizer.eos_token_id,
        )
    res.end = time.time()
    res.token_times = clock.times
    res.completion_tokens = out.shape[1] - ids.shape[1]
    return res


def bench_hf_generate(args: argparse.Namespace, run: int) -> list[Row]:
    """Plain `generate`, one request at a time; as many requests as one stream of the other systems sends."""
    model, tokenizer, device = load_hf(args)
    hf_generate_one(model, tokenizer, device, PROMPTS[0], 4)  # warm-up
    start = time.time()
    n = args.requests_per_stream
    results = [hf_generate_one(model, tokenizer, device, PROMPTS[i % len(PROMPTS)], args.max_tokens) for i in range(n)]
    row = make_row(run, HF_GENERATE, 1, results, time.time() - start)
    print(f"  {HF_GENERATE} @1: {row.tok_s:.1f} tok/s")
    return [row]


# --- rounds ---------------------------------------------------------------------------------------------


def run_round(args: argparse.Namespace, run: int, outcome: Outcome) -> None:
    """Starts each system in turn, alone; a start that fails is reported and the round goes on."""
    starts: list[tuple[str, Callable[[], list[Row]]]] = [(CHATQ, lambda: chatq_rows(args, run, outcome))]
    if args.baselines:
        starts += [
            (SERVE_SIZED, lambda: bench_serve(args, run, sized=True)),
            (SERVE_DEFAULTS, lambda: bench_serve(args, run, sized=False)),
            (HF_GENERATE, lambda: bench_hf_generate(args, run)),
        ]
    for system, start in starts:
        print(f"run {run}/{args.runs}: {system}", flush=True)
        began = time.time()
        try:
            outcome.rows += start()
        except Exception as e:  # one failed start should not lose the other rounds
            outcome.failures.append(f"run {run} {system}: {e!r}"[:500])
            print(f"  FAILED: {e!r}", file=sys.stderr)
        print(f"  ({time.time() - began:.0f} s with start and stop)", flush=True)


def chatq_rows(args: argparse.Namespace, run: int, outcome: Outcome) -> list[Row]:
    rows, used_ignore_eos = bench_chatq(args, run)
    outcome.ignore_eos.append(used_ignore_eos)
    return rows


# --- ratios and output ----------------------------------------------------------------------------------


def ratio_keys(args: argparse.Namespace) -> list[tuple[str, tuple[str, int], tuple[str, int]]]:
    """(key, numerator, denominator) per ratio, each side a (system, concurrency)."""
    pairs: list[tuple[tuple[str, int], tuple[str, int]]] = []
    if args.baselines:
        pairs += [((CHATQ, c), (serve, c)) for serve in (SERVE_SIZED, SERVE_DEFAULTS) for c in args.concurrency]
    if 1 in args.concurrency:
        pairs += [((CHATQ, c), (CHATQ, 1)) for c in args.concurrency if c != 1]
    return [(f"{a[0]}@{a[1]} / {b[0]}@{b[1]}", a, b) for a, b in pairs]


def ratio_lists(args: argparse.Namespace, rows: list[Row]) -> dict[str, list[float | None]]:
    """Each ratio of aggregate tok/s, one value per round (None where a side is missing or zero)."""
    tok_s = {(r.run, r.system, r.concurrency): r.tok_s for r in rows}
    out: dict[str, list[float | None]] = {}
    for key, (sa, ca), (sb, cb) in ratio_keys(args):
        values: list[float | None] = []
        for run in range(1, args.runs + 1):
            a, b = tok_s.get((run, sa, ca)), tok_s.get((run, sb, cb))
            values.append(a / b if a is not None and b else None)
        out[key] = values
    return out


def spread(values: list[float | None]) -> tuple[float, float, float] | None:
    """(min, median, max) of the measured values; None when none were."""
    got = [v for v in values if v is not None]
    return (min(got), statistics.median(got), max(got)) if got else None


def x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def ratios_table(lists: dict[str, list[float | None]], runs: int) -> str:
    headers = ["ratio of aggregate tok/s", *(f"run {k}" for k in range(1, runs + 1)), "min-max", "median"]
    lines = []
    for key, values in lists.items():
        s = spread(values)
        summary = ["-", "-"] if s is None else [f"{s[0]:.2f}-{s[2]:.2f}", f"{s[1]:.2f}"]
        lines.append([key, *map(x, values), *summary])
    return table(headers, lines)


def verdicts(lists: dict[str, list[float | None]]) -> list[str]:
    out = []
    for key, target in TARGETS:
        s = spread(lists.get(key, []))
        if s is None:
            out.append(f"{key} >= {target:g}x: not measured")
            continue
        missing = sum(v is None for v in lists[key])
        note = f", {missing} round(s) not measured" if missing else ""
        state = "MET" if s[0] >= target else "NOT MET"
        out.append(f"{key} >= {target:g}x: {state} (min {s[0]:.2f}x, median {s[1]:.2f}x{note})")
    return out


def rows_table(rows: list[Row]) -> str:
    headers = ["system", "run", "conc", "reqs", "err", "tokens", "tok/req", "wall s", "tok/s"]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    return table(
        headers,
        [
            [r.system, r.run, r.concurrency, r.requests, r.errors, r.tokens, f"{r.tokens_per_request:.1f}"]
            + [f"{r.wall_s:.2f}", f"{r.tok_s:.1f}", ms(r.ttft_p50_s), ms(r.ttft_p99_s)]
            + [ms(r.itl_p50_s), ms(r.itl_p99_s)]
            for r in rows
        ],
    )


def report(args: argparse.Namespace, outcome: Outcome) -> None:
    print(
        f"\nmodel {args.model_dir.name} on {args.device}, dtype {args.dtype}; max_tokens {args.max_tokens}; "
        f"{args.requests_per_stream} requests per stream; {args.runs} round(s); "
        f"chatq ignore_eos: {outcome.ignore_eos}\n"
    )
    print(rows_table(outcome.rows))
    lists = ratio_lists(args, outcome.rows)
    found = verdicts(lists)
    print()
    print(ratios_table(lists, args.runs))
    print("\ntargets (MET: the minimum across rounds reaches it):\n  " + "\n  ".join(found))
    if outcome.failures:
        print("\nfailed starts:\n  " + "\n  ".join(outcome.failures))
    write_json(
        args.out,
        {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            | {"chatq_ignore_eos": outcome.ignore_eos, "prompts": PROMPTS},
            "rows": [asdict(r) for r in outcome.rows],
            "ratios": lists,
            "ratio_spread": {
                k: dict(zip(("min", "median", "max"), s, strict=True)) if (s := spread(v)) else None
                for k, v in lists.items()
            },
            "targets": found,
            "failures": outcome.failures,
        },
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="rounds; each starts every system once, in turn")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 64])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cpu", help="for all systems: cpu (default), cuda or auto")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "auto"],
        help="for all systems (chatq: CHATQ_DTYPE, serve: --dtype); auto: each one's own default",
    )
    parser.add_argument("--cb-num-blocks", type=int, default=512, help="serve (sized): KV cache blocks")
    parser.add_argument("--cb-block-size", type=int, default=32, help="serve (sized): tokens per KV cache block")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=1024, help="serve (sized): tokens per batch")
    parser.add_argument("--model-dir", type=Path, default=Settings().model_dir)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads for every system (OMP_NUM_THREADS); 0: torch's default",
    )
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the service logs (paths printed)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    outcome = Outcome()
    for run in range(1, args.runs + 1):
        run_round(args, run, outcome)
    report(args, outcome)
    return 1 if outcome.failures else 0


if __name__ == "__main__":
    sys.exit(main())
