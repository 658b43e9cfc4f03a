"""A beam search's step in the engine: once every running beam of a search has its row of log-probabilities, the
search (chatq.worker.beam) picks the beams that go on, and the engine's sequences take them on, each slot its new
beam's tokens and, sharing them, its parent's KV blocks; once the search ends, each slot its answer."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from chatq.worker.engine import Engine, Finish, Output, _rank

if TYPE_CHECKING:
    from chatq.worker.beam import BeamGroup, Hypothesis


def advance_beams(engine: Engine, group: BeamGroup) -> list[Output]:
    """One step of a beam search: each slot takes its new beam's tokens and, sharing them, its parent's blocks;
    once the search ends, each slot its answer."""
    beams = group.seqs[: group.running]
    rows = torch.stack([group.rows.pop(s.id) for s in beams])
    step = group.search.advance(rows, [s.output_ids for s in beams])
    if step.answer is not None:
        return _end_beams(engine, group, step.answer)
    forks, continued = [], set()
    for parent, token in zip(step.parents, step.tokens, strict=True):
        p = beams[parent]
        # A parent's first child continues its context rows; the others' are copied anew.
        context = p.context or p.id if parent not in continued else f"{p.id}+{next(engine._contexts)}"
        continued.add(parent)
        forks.append((p.output_ids + [token], list(p.blocks), list(p.block_hashes), p.num_cached, context))
        engine.blocks.share(p.blocks)
    for seq in beams:
        engine._release(seq)
    for seq, (output_ids, blocks, hashes, cached, context) in zip(group.seqs, forks, strict=True):
        seq.output_ids, seq.blocks, seq.block_hashes, seq.num_cached = output_ids, blocks, hashes, cached
        seq.context = context
        if seq in engine.parked:
            engine.parked.remove(seq)
            seq.arrival = next(engine._order)
            bisect.insort(engine.running, seq, key=_rank)
        copied = engine.blocks.own_last(seq)
        if copied is not None:
            engine.cache.copy_block(copied, seq.blocks[-1])
        elif seq.num_cached != cached:  # its last block let go, to be computed again
            seq.context = f"{seq.id}+{next(engine._contexts)}"
    group.running = len(group.seqs)
    return []


def _end_beams(engine: Engine, group: BeamGroup, answer: list[Hypothesis]) -> list[Output]:
    outputs = []
    for i, seq in enumerate(group.seqs):
        if seq in engine.running:
            engine.running.remove(seq)
        if seq in engine.parked:
            engine.parked.remove(seq)
        if i >= len(answer):  # fewer answers than beams: none left that could end
            outputs.append(engine._finish(seq, Finish.error, "beam search found fewer answers than beams"))
            continue
        seq.output_ids = answer[i].tokens
        outputs.append(engine._finish(seq, Finish.stop if answer[i].ended else Finish.length))
    return outputs
