"""Where a decode step's time goes, beside the floor of the same run.

Run from the repository root:

    .venv/bin/python bench/step_profile.py [--batch 1,8,32,64] [--steps 12] [--context 100] [--dtype float32]
                                           [--runs 1] [--context-in rows,gathered]

A real worker's engine loop (runner, engine, detokenizer, parsers, publisher) runs B streamed, greedy,
`ignore_eos` jobs against a real Redis; once all of them decode, each phase of its steps is timed:

- forward: the model's pass over the paged cache, of which attention is the decode attention (placing contexts
  in their rows, or gathering them, included), and dense is the rest (projections, MLPs, norms, rotary, the output
  head);
- sampling: logits processing and the pick;
- text: detokenize, parse and build each job's chunks;
- redis: the step's one write (events, records, cancels read back);
- idle: the loop's own time outside those; loop is the whole, per step.

Floors, measured in the same run between the levels, in a process of their own:

- gemm: the model's matrix multiplies alone at that batch, `torch.mm` on each weight of every layer in turn and on
  the output head, as a step reads them;
- packed: the same products through the engine's own kernels (oneDNN's packed weights, on CPU);
- hf: a bare transformers forward of one token per row over its own cache of `--context` tokens.

`--context-in rows,gathered` runs each level twice in turn: decode attention reading the engine's context rows, and
gathering each context from the paged cache instead, as a batch does whose rows would not fit.

Phases are means over the counted steps; "fastest step" is the quickest of them, the statistic the floors (each the
best of a few tries) use, so fastest/gemm compares like with like on a host whose speed drifts. The last column is
where the step exceeds the GEMM floor. Target (issue 21): the step at 32 within 1.3x of gemm.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch import nn  # noqa: E402

from bench.common import table  # noqa: E402
from chatq.core import keys  # noqa: E402
from chatq.core.chat_request import ChatCompletionRequest  # noqa: E402
from chatq.core.job import Job  # noqa: E402
from chatq.core.model_info import ModelInfo  # noqa: E402
from chatq.core.settings import Settings  # noqa: E402
from chatq.embedded_redis import EmbeddedRedis  # noqa: E402
from chatq.worker import attention, dense  # noqa: E402
from chatq.worker.build import build_runner  # noqa: E402
from chatq.worker.runner import Runner  # noqa: E402

WORKER = "step-profile@bench"
PHASES = ["loop", "step", "forward", "attention", "dense", "sampling", "text", "redis", "idle"]


class Clocks:
    """Seconds spent in wrapped callables, by phase, for each iteration of the engine loop."""

    def __init__(self) -> None:
        self.iterations: list[tuple[float, float, dict[str, float]]] = []  # (start, end, seconds by phase)
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def wrap_iteration(self, runner: Runner) -> None:
        inner = runner._iterate

        def timed() -> None:
            self.current = defaultdict(float)
            start = time.perf_counter()
            try:
                inner()
            finally:
                self.iterations.append((start, time.perf_counter(), self.current))

        runner._iterate = timed  # type: ignore[method-assign]


def instrument(runner: Runner, clocks: Clocks) -> None:
    engine = runner.engine
    clocks.wrap_iteration(runner)
    clocks.wrap(runner, "_step", "step")
    clocks.wrap(runner, "_route", "text")
    clocks.wrap(runner, "_close_or_progress", "text")
    clocks.wrap(runner.publisher, "flush", "redis")
    if engine.forward.rows is not None:
        clocks.wrap(engine.forward.rows, "place", "attention")
        clocks.wrap(engine.forward.rows, "attend", "attention")
    clocks.wrap(engine, "forward", "forward")
    clocks.wrap(engine, "_sample", "sampling")
    clocks.wrap(attention, "gather_context", "attention")
    clocks.wrap(attention, "decode_sdpa", "attention")
    clocks.wrap(attention, "decode_paged", "attention")


def make_job(model: ModelInfo, index: int, batch: int, context: int, max_tokens: int) -> Job:
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        ignore_eos=True,
    )
    prompt = [(7 * index + t) % 4000 + 100 for t in range(context)]  # distinct prompts: no prefix-cache sharing
    return Job(id=f"chatcmpl-profile-{batch}-{index}", model=model.name, request=request, prompt_ids=prompt)


def decoding(runner: Runner, batch: int) -> bool:
    engine = runner.engine
    return len(engine.running) == batch and all(len(s) - s.num_cached == 1 for s in engine.running)


def profile_level(runner: Runner, r: redis.Redis, clocks: Clocks, args: argparse.Namespace, batch: int) -> dict:
    """Per-step milliseconds of each phase while `batch` jobs decode."""
    engine = runner.engine
    jobs = [make_job(runner.model, i, batch, args.context, 10**6) for i in range(batch)]
    for j in jobs:  # as the API's submit and a worker's claim leave them
        r.hset(keys.job(j.id), mapping=j.to_redis() | {"status": "in_progress", "worker": WORKER})
    runs = [runner.submit(j) for j in jobs]
    while not decoding(runner, batch):
        time.sleep(0.05)
    time.sleep(0.5)  # a few decode steps before counting
    counted = len(clocks.iterations)
    while sum("forward" in i[2] for i in clocks.iterations[counted:]) < args.steps + 1:
        time.sleep(0.01)
    window = clocks.iterations[counted:]
    for run in runs:
        for c in run.choices:
            engine.cancel(c.seq.id)
    for run in runs:
        run.done.wait(60)
    return per_step(window)


def per_step(window: list[tuple[float, float, dict[str, float]]]) -> dict[str, float]:
    """Milliseconds per step of each phase over whole iterations, from one step's start to the last one's."""
    steps = [i for i, (_, _, spent) in enumerate(window) if "forward" in spent]
    first, last = steps[0], steps[-1]
    n = len(steps) - 1
    spent: dict[str, float] = defaultdict(float)
    for _, _, phases in window[first:last]:
        for k, v in phases.items():
            spent[k] += v * 1e3 / n
    spent["loop"] = (window[last][0] - window[first][0]) * 1e3 / n
    spent["dense"] = spent["forward"] - spent["attention"]
    spent["idle"] = spent["loop"] - spent["step"] - spent["text"] - spent["redis"]
    # The floors are each the best of a few tries; the fastest step is the same statistic on this side.
    spent["fastest"] = min(window[i][2]["step"] for i in steps[:-1]) * 1e3
    return spent


def best_of(repeats: int, run: Callable[[], object]) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def linears(model: Any) -> list[nn.Linear]:
    """Every linear layer a step multiplies by, in the order a step does."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    return [*out, model.lm_head]


def gemm_floor(model: Any, batch: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """torch.mm on every weight of a step, at `batch` rows."""
    weights = [linear.weight.detach().to(dtype).contiguous().t() for linear in linears(model)]
    inputs = {w.shape[0]: torch.randn(batch, w.shape[0], dtype=dtype) for w in weights}

    def step() -> None:
        for w in weights:
            torch.mm(inputs[w.shape[0]], w)

    with torch.inference_mode():
        return best_of(repeats, step) * 1e3


def packed_floor(model: Any, batch: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """The same products through the engine's own kernels (chatq.worker.dense): oneDNN's, on CPU."""
    packed = dense.can_pack(torch.device("cpu"), dtype)
    layers = [dense.Dense(linear, packed) for linear in linears(model)]
    inputs = {d.weight.shape[1]: torch.randn(batch, d.weight.shape[1], dtype=dtype) for d in layers}

    def step() -> None:
        for d in layers:
            d(inputs[d.weight.shape[1]])

    with torch.inference_mode():
        return best_of(repeats, step) * 1e3


def hf_step(model: Any, batch: int, context: int, repeats: int = 3) -> float:
    """One decode step of plain transformers: a token per row over a DynamicCache of `context` tokens."""
    from transformers import DynamicCache

    ids = torch.randint(100, 4000, (batch, context))
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids, cache=cache, use_cache=True)
        token = torch.randint(100, 4000, (batch, 1))

        def step() -> None:
            model(input_ids=token, cache=cache, use_cache=True)
            cache.crop(-1)

        return best_of(repeats, step) * 1e3


_bare: dict[tuple[str, str], Any] = {}


def floors(model_dir: str, dtype_name: str, batch: int, context: int) -> tuple[float, float, float]:
    """The three floors at `batch` rows (gemm, packed, hf), in the floor process."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    if (model_dir, dtype_name) not in _bare:
        _bare[model_dir, dtype_name] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    bare = _bare[model_dir, dtype_name]
    return gemm_floor(bare, batch, dtype), packed_floor(bare, batch, dtype), hf_step(bare, batch, context)


def row(batch: int, spent: dict[str, float], gemm: float, packed: float, hf: float) -> list[object]:
    over = {k: spent.get(k, 0.0) for k in ("attention", "sampling", "text", "redis", "idle")}
    over["dense"] = spent["dense"] - gemm
    where = ", ".join(f"{k} {v:.0f}" for k, v in sorted(over.items(), key=lambda kv: -kv[1]) if v >= 1)
    cells = [f"{spent.get(p, 0.0):.1f}" for p in PHASES]
    ratios = [spent["step"] / gemm, spent["fastest"] / gemm, spent["step"] / packed, spent["step"] / hf]
    floors = [f"{x:.1f}" for x in (spent["fastest"], gemm, packed, hf)]
    return [batch, *cells, *floors, *(f"{x:.2f}" for x in ratios), where]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=12, help="decode steps counted per level")
    parser.add_argument("--context", type=int, default=100, help="prompt tokens per sequence")
    parser.add_argument("--dtype", default="float32", help="CHATQ_DTYPE for the engine and the floors")
    parser.add_argument("--runs", type=int, default=1, help="rounds over every level (reported one by one)")
    parser.add_argument(
        "--context-in",
        type=lambda s: s.split(","),
        default=["rows"],
        help="where CPU decode attention reads the context: rows (the engine's), gathered, or both in turn",
    )
    args = parser.parse_args(argv)

    # The floors run in a process of their own: torch keeps a compute-thread pool per calling thread, and a second
    # pool in this process would slow the engine thread's steps (docs/performance.md).
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="chatq-step-profile-") as tmp, ProcessPoolExecutor(1, spawn) as floor:
        server = EmbeddedRedis(Path(tmp), persist=False).start()
        try:
            rows = run_levels(args, Settings(redis_url=server.url, dtype=args.dtype), floor)
        finally:
            server.stop()
    headers = ["context", "batch", *[f"{p} ms" for p in PHASES], "fastest step ms", "gemm ms", "packed ms", "hf ms"]
    headers += ["step/gemm", "fastest/gemm", "step/packed", "step/hf"]
    print(table([*headers, "over the gemm floor, ms"], rows))
    return 0


def run_levels(args: argparse.Namespace, settings: Settings, floor_process: Executor) -> list[list[object]]:
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    runner = build_runner(settings, r, WORKER)
    runner.start()
    forward = runner.engine.forward  # before instrument() wraps it
    context_rows = forward.rows
    clocks = Clocks()
    instrument(runner, clocks)
    rows = []
    try:
        for _ in range(args.runs):
            for batch in args.batch:
                for context in args.context_in:
                    # Between levels no sequence decodes, so the engine thread sees the switch at a step boundary.
                    forward.rows = context_rows if context == "rows" else None
                    spent = profile_level(runner, r, clocks, args, batch)
                    measured = floor_process.submit(floors, str(settings.model_dir), args.dtype, batch, args.context)
                    gemm, packed, hf = measured.result()
                    rows.append([context, *row(batch, spent, gemm, packed, hf)])
                    print(f"  batch {batch}, {context}: step {spent['step']:.1f} ms, gemm {gemm:.1f}", flush=True)
    finally:
        runner.stop()
    return rows


if __name__ == "__main__":
    sys.exit(main())
