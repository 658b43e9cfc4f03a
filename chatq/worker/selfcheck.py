"""A CUDA engine's start: its fast paths checked on this device against the plain one, the fastest that agrees kept.

The Triton decode kernel and the captured decode graphs are what make a GPU step fast, and either could be wrong on
a GPU, driver or Triton build it has not met. Before the worker registers, the kernel is compared with SDPA over
lengths that cross its tiles and the cache's blocks, each captured graph with the eager step it replays, and a few
greedy tokens of the engine (chunked prompts, a prefix-cache hit, decode steps) with transformers' own forward over
the whole text. The engine keeps the fastest mode whose checks pass: graphs, then the kernel alone, then neither; an
engine whose plain path disagrees with transformers refuses to start. Each check is logged with its numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from chatq.worker import attention
from chatq.worker.forward import Batch
from chatq.worker.sampler import SamplingParams

if TYPE_CHECKING:
    from chatq.worker.engine import Engine

log = logging.getLogger(__name__)

# The largest error, relative to the largest value, each check allows in the model's dtype: the dtype's rounding
# stays well below it, a wrong kernel or step lands far above it (or at NaN).
BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
GREEDY_TOKENS = 6


class EngineRefused(RuntimeError):
    """Even the plain path disagrees with transformers on this device: the worker must not serve."""


@dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {'pass' if self.passed else 'FAIL'} ({self.detail})"


def start(engine: Engine, model: Any, graph_batch: int) -> list[Check]:
    """Checks the engine's fast paths and leaves it in the fastest mode that agrees (its `mode`); the checks made.
    Raises EngineRefused when the plain path disagrees too."""
    checks: list[Check] = []
    bound = BOUND.get(engine.cache.k[0].dtype, 3e-2)
    if engine.forward.paged:
        checks.append(_kernel(engine, bound))
        engine.forward.paged = checks[-1].passed
    if graph_batch > 0 and engine.forward.paged:
        engine.graphs = engine.capture_graphs(graph_batch)
        checks.append(
            _graphs(engine, bound) if engine.graphs else Check("decode graphs captured", False, "see the log")
        )
        if not checks[-1].passed:
            engine.graphs = None
    while True:
        checks.append(_greedy(engine, model, bound))
        if checks[-1].passed:
            break
        if not engine.degrade(checks[-1].detail):
            _report(engine, checks)
            raise EngineRefused(f"the engine disagrees with transformers on {engine.device}: {checks[-1].detail}")
    _report(engine, checks)
    return checks


def _report(engine: Engine, checks: list[Check]) -> None:
    for c in checks:
        (log.info if c.passed else log.error)("start check on %s, %s", engine.device, c)
    log.info("the engine runs in mode %s", engine.mode)


def _kernel(engine: Engine, bound: float) -> Check:
    forward, kc = engine.forward, engine.cache.k[0]
    shape = (forward.heads, kc.shape[1], forward.head_dim, engine.block_size)
    error = attention.paged_decode_error(*shape, kc.dtype, kc.device)
    return Check("paged decode kernel against SDPA", error <= bound, f"relative error {error:.3g}, bound {bound:g}")


def _graphs(engine: Engine, bound: float) -> Check:
    """Each bucket's replay against the eager step over the same rows: decodes of one to three blocks of context,
    each sequence in blocks of its own, filled with random keys and values."""
    graphs = engine.graphs
    assert graphs is not None
    block, dev = engine.block_size, engine.device
    gen = torch.Generator().manual_seed(0)
    width = max(1, min(3, engine.blocks.num_blocks // graphs.max_batch))
    filled = graphs.max_batch * width * block
    noise = torch.Generator(device=dev).manual_seed(0)
    for cache in (*engine.cache.k, *engine.cache.v):
        cache[:filled] = torch.randn(cache[:filled].shape, generator=noise, device=dev, dtype=cache.dtype)
    worst, at = 0.0, 0
    for n in graphs.sizes:
        lens = torch.randint(1, width * block + 1, (n,), generator=gen)
        table = torch.arange(n * width).view(n, width) % engine.blocks.num_blocks
        last = lens - 1
        batch = Batch(
            input_ids=torch.randint(0, engine.vocab_size, (n,), generator=gen).to(dev),
            positions=last.to(dev),
            slots=(table.gather(1, (last // block)[:, None])[:, 0] * block + last % block).to(dev),
            num_decode=n,
            dec_table=table.to(dev, torch.int32),
            dec_lens=lens.to(dev, torch.int32),
            prefills=[],
            logits_at=None,
        )
        eager = engine.forward(batch)
        error = _relative(graphs(batch), eager)
        if error > worst:
            worst, at = error, n
    detail = f"{len(graphs.sizes)} buckets up to {graphs.max_batch}, largest relative error {worst:.3g}"
    return Check("decode graphs against eager steps", worst <= bound, f"{detail} (at {at}), bound {bound:g}")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest value; NaN anywhere is infinitely far."""
    error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    return error if error == error else float("inf")


def _greedy(engine: Engine, model: Any, bound: float) -> Check:
    """A few greedy tokens of three sequences against transformers' argmax over each whole text: prompts in chunks
    of one block, a second prompt sharing the first's two leading blocks (a prefix-cache hit), decode steps of one
    to three sequences. A difference where transformers' top two logits are within the bound of each other is a
    near-tie that two summation orders split, not a wrong step."""
    from chatq.worker.engine import Sequence

    block, vocab = engine.block_size, engine.vocab_size
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, vocab, (3 * block + 5,), generator=gen).tolist()
    prompts = [first, first[: 2 * block] + torch.randint(0, vocab, (7,), generator=gen).tolist()]
    prompts.append(torch.randint(0, vocab, (5 * block + 3,), generator=gen).tolist())
    mode, chunk, engine.prefill_chunk = engine.mode, engine.prefill_chunk, block
    try:
        outputs = _generate(engine, [Sequence(f"start-check/{i}", p, _greedy_params()) for i, p in enumerate(prompts)])
    finally:
        engine.prefill_chunk = chunk
        engine.reset()
    differences = [f"a {len(p)}-token prompt made {len(o)} tokens" for p, o in zip(prompts, outputs, strict=True)]
    differences = [d for d, o in zip(differences, outputs, strict=True) if len(o) != GREEDY_TOKENS]
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs, strict=True):
            logits = model(torch.tensor([prompt + out], device=engine.device)).logits[0, len(prompt) - 1 : -1].float()
            want = logits.argmax(-1).tolist()
            for k, (w, g) in enumerate(zip(want, out, strict=True)):
                margin = float(logits[k, w] - logits[k, g])
                if w != g and margin > bound * float(logits[k].abs().max()):
                    differences.append(
                        f"token {k} of a {len(prompt)}-token prompt: {g}, transformers {w} by {margin:.3g}"
                    )
                    break
    made = sum(len(o) for o in outputs)
    detail = "; ".join(differences) or f"{made} tokens equal, or near-ties"
    return Check(f"greedy tokens against transformers in mode {mode}", not differences, detail)


def _greedy_params() -> SamplingParams:
    return SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0)


def _generate(engine: Engine, seqs: list[Any]) -> list[list[int]]:
    """Each sequence's tokens, the second added once the first's prompt blocks are cached."""
    engine.add(seqs[0])
    while seqs[0].num_cached < len(seqs[0].prompt_ids) and seqs[0].finish is None:
        engine.step()
    for seq in seqs[1:]:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    return [s.output_ids if s.error is None else [] for s in seqs]
