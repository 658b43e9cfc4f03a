"""Throughput and latency of chatq through the whole stack (HTTP -> Redis -> worker -> Redis -> SSE), beside
`transformers serve --continuous-batching` and plain HF `generate` (batch 1) on the same model and load.

Run from the repository root (the script puts the root on sys.path; `python -m bench.stack` works too):

    .venv/bin/python bench/stack.py [--concurrency 1,8,32,64] [--requests-per-stream 4] [--max-tokens 128]
                                    [--no-baselines] [--device cpu] [--threads N] [--out results.json] [--keep-logs]

Load: at concurrency c, c client streams each send --requests-per-stream streamed requests one after another
(closed loop), cycling through the same prompts ("Write a very long story about ..."), temperature 0, max_tokens
fixed, stream_options.include_usage. Both servers get the same body; chatq also gets `ignore_eos: true` when its API
accepts it (probed first; a 400 means not yet), otherwise output lengths are whatever the model says before EOS, so
token counts are always taken from the usage chunk. Each system is started alone (one at a time, so they do not
share the CPU), warmed up with one request, measured, and stopped.

Columns: aggregate output tokens/s = all completion tokens / wall time of the level; TTFT = time to the first chunk
with non-empty content; ITL = gaps between consecutive content chunks of a request; for HF generate both come from
a streamer's token callbacks. Targets (from the issue): chatq at 32 streams >= 8x chatq at 1 stream, and >= 1.5x
transformers serve at 32 streams; reported, not tuned here.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
TARGET_SCALE, TARGET_VS_TSERVE, TARGET_AT = 8.0, 1.5, 32


@dataclass
class Row:
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


def make_row(system: str, concurrency: int, results: list[StreamResult], wall: float) -> Row:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    itls = [g for r in ok for g in r.itls]
    return Row(
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
    system: str, url: str, make_body: Callable[[int], dict[str, Any]], args: argparse.Namespace
) -> list[Row]:
    warm, _ = await run_level(url, make_body, 1, 1)
    if warm[0].error:
        raise RuntimeError(f"{system}: warm-up request failed: {warm[0].error}")
    rows = []
    for c in args.concurrency:
        results, wall = await run_level(url, make_body, c, args.requests_per_stream)
        row = make_row(system, c, results, wall)
        errors = {r.error for r in results if r.error}
        print(f"  {system} @{c}: {row.tok_s:.1f} tok/s" + (f", errors: {sorted(errors)[:3]}" if errors else ""))
        rows.append(row)
    return rows


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


def bench_chatq(args: argparse.Namespace) -> tuple[list[Row], bool]:
    # The product default (64) unless a level needs more jobs at once than that.
    with Services(
        max(64, *args.concurrency), device=args.device, keep_logs=args.keep_logs, extra_env=thread_env(args)
    ) as svc:
        name = svc.settings.model_name
        use_ignore_eos = ignore_eos_accepted(svc.base_url, name)
        extra = {"ignore_eos": True} if use_ignore_eos else {}
        print(f"chatq: ignore_eos {'accepted' if use_ignore_eos else 'refused (400): long-story prompts only'}")
        url = f"{svc.base_url}/v1/chat/completions"
        rows = asyncio.run(
            measure("chatq", url, lambda i: body(name, PROMPTS[i % len(PROMPTS)], args.max_tokens, extra), args)
        )
    return rows, use_ignore_eos


def bench_transformers_serve(args: argparse.Namespace) -> list[Row]:
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "transformers"),
        "serve",
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        args.device,
        "--log-level",
        "warning",
        str(args.model_dir),
    ]
    with tempfile.TemporaryDirectory(prefix="chatq-bench-tserve-") as tmp:
        proc = Proc("transformers-serve", command, dict(os.environ) | thread_env(args), Path(tmp))
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", [proc])
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            model = str(args.model_dir)  # the server is pinned to it (FORCE_MODEL); other names are a 400

            def make_body(i: int) -> dict[str, Any]:
                return body(model, PROMPTS[i % len(PROMPTS)], args.max_tokens, {})

            return asyncio.run(measure("transformers-serve", url, make_body, args))
        finally:
            proc.stop()


def bench_hf_generate(args: argparse.Namespace) -> Row:
    """Plain `generate`, one request at a time, greedy, exactly max_tokens new tokens (min_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if self.prompt_seen:  # the first call carries the prompt, each later one a new token
                self.times.append(time.time())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    model = model.to(device).eval()

    def generate(prompt: str, n: int) -> StreamResult:
        encoded: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        ids = encoded["input_ids"].to(device)
        clock = Clock()
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

    generate(PROMPTS[0], 4)  # warm-up
    start = time.time()
    results = [generate(PROMPTS[i % len(PROMPTS)], args.max_tokens) for i in range(args.requests_per_stream)]
    row = make_row("hf-generate (batch 1)", 1, results, time.time() - start)
    print(f"  hf-generate @1: {row.tok_s:.1f} tok/s")
    return row


def ratios(rows: list[Row]) -> tuple[dict[str, float], list[str]]:
    chatq = {r.concurrency: r.tok_s for r in rows if r.system == "chatq"}
    tserve = {r.concurrency: r.tok_s for r in rows if r.system == "transformers-serve"}
    out: dict[str, float] = {}
    for c in sorted(chatq):
        if c != 1 and chatq.get(1):
            out[f"chatq@{c} / chatq@1"] = chatq[c] / chatq[1]
    for c in sorted(chatq):
        if tserve.get(c):
            out[f"chatq@{c} / transformers-serve@{c}"] = chatq[c] / tserve[c]
    verdicts = []
    for key, target in (
        (f"chatq@{TARGET_AT} / chatq@1", TARGET_SCALE),
        (f"chatq@{TARGET_AT} / transformers-serve@{TARGET_AT}", TARGET_VS_TSERVE),
    ):
        got = out.get(key)
        state = "not measured" if got is None else ("MET" if got >= target else "NOT MET")
        verdicts.append(f"{key} >= {target:g}x: {state}" + ("" if got is None else f" ({got:.2f}x)"))
    return out, verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cpu", help="for all three systems: cpu (default), cuda or auto")
    parser.add_argument("--model-dir", type=Path, default=Settings().model_dir)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads for every system (OMP_NUM_THREADS); 0: torch's default",
    )
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--keep-logs", action="store_true", help="keep chatq's service logs (path printed at the end)")
    args = parser.parse_args(argv)

    rows, used_ignore_eos = bench_chatq(args)
    if args.baselines:
        rows += bench_transformers_serve(args)
        rows.append(bench_hf_generate(args))

    print(
        f"\nmodel {args.model_dir.name} on {args.device}; max_tokens {args.max_tokens}; "
        f"{args.requests_per_stream} requests per stream; chatq ignore_eos: {used_ignore_eos}\n"
    )
    headers = ["system", "conc", "reqs", "err", "tokens", "tok/req", "wall s", "tok/s"]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    print(
        table(
            headers,
            [
                [r.system, r.concurrency, r.requests, r.errors, r.tokens, f"{r.tokens_per_request:.1f}"]
                + [f"{r.wall_s:.2f}", f"{r.tok_s:.1f}", ms(r.ttft_p50_s), ms(r.ttft_p99_s)]
                + [ms(r.itl_p50_s), ms(r.itl_p99_s)]
                for r in rows
            ],
        )
    )
    found, verdicts = ratios(rows)
    print()
    print(table(["ratio of aggregate tok/s", "x"], [[k, f"{v:.2f}"] for k, v in found.items()]))
    print("\ntargets:\n  " + "\n  ".join(verdicts))
    write_json(
        args.out,
        {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            | {"chatq_ignore_eos": used_ignore_eos, "prompts": PROMPTS},
            "rows": [asdict(r) for r in rows],
            "ratios": found,
            "targets": verdicts,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
