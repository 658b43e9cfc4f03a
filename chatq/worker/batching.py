"""A step's batch, built from the sequences the scheduler picked and how many new tokens each feeds: their ids,
positions and cache slots, the decodes' block tables, and which rows of logits come back (those that sample, then
the prompt tokens scored for prompt_logprobs); and those prompt tokens' logprobs once the pass made their rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chatq.worker.forward import Batch
from chatq.worker.lora import Resident
from chatq.worker.sampler import TokenLogprob, to_device

if TYPE_CHECKING:
    from chatq.worker.engine import Sequence


def build_batch(
    scheduled: list[tuple[Sequence, int]], block_size: int, device: torch.device, lora: Resident | None = None
) -> tuple[Batch, list[Sequence], list[Scored]]:
    """The step's batch; the sequences that sample, whose logits come first; the prompt tokens scored, whose
    logits follow in that order. `lora`: the adapters the forward pass holds, which the sequences' slots are of."""
    # Per-token Python work covers only the new tokens; anything proportional to context length (slot tables,
    # masks) uses tensor ops, as a step may carry hundreds of long-context sequences.
    bs, dev = block_size, device
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    logits_at: list[int] = []
    emitting: list[Sequence] = []
    score_at: list[int] = []
    scored: list[Scored] = []
    decodes: list[Sequence] = []
    prefills: list[tuple[int, int, torch.Tensor]] = []
    lora_rows: list[int] = []
    for seq, n in scheduled:
        lora_rows.extend([seq.lora_slot] * n)
        start = len(ids)
        first = seq.num_cached
        ids.extend(_tokens(seq, first, first + n))
        pos.extend(range(first, first + n))
        slots.extend(seq.blocks[i // bs] * bs + i % bs for i in range(first, first + n))
        if first + n == len(seq):
            logits_at.append(start + n - 1)
            emitting.append(seq)
        if positions := seq.scored_positions(first, n):
            score_at.extend(start + p - first for p in positions)
            scored.append(Scored(seq, seq.prompt_ids[positions.start + 1 : positions.stop + 1]))
        if n == 1 and first + 1 == len(seq) and not prefills:
            decodes.append(seq)
            continue
        prefills.append((start, start + n, _slots(to_device(dev, seq.blocks), first + n, bs, dev)))
    dec_table = dec_lens = None
    if decodes:
        width = max(len(s.blocks) for s in decodes)
        dec_table = to_device(dev, [s.blocks + [0] * (width - len(s.blocks)) for s in decodes], torch.int32)
        dec_lens = to_device(dev, [len(s) for s in decodes], torch.int32)
    batch = Batch(
        input_ids=to_device(dev, ids),
        positions=to_device(dev, pos),
        slots=to_device(dev, slots),
        num_decode=len(decodes),
        dec_table=dec_table,
        dec_lens=dec_lens,
        prefills=prefills,
        logits_at=None if not score_at and len(logits_at) == len(ids) else to_device(dev, logits_at + score_at),
        dec_ids=[s.context or s.id for s in decodes],
        lora_rows=lora.rows(lora_rows) if lora is not None and any(s.lora for s, _ in scheduled) else None,
    )
    return batch, emitting, scored


def _slots(blocks: torch.Tensor, length: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Cache slots of a sequence's first `length` tokens, from its blocks (on the device)."""
    bs = block_size
    return (blocks[:, None] * bs + torch.arange(bs, device=device)).flatten()[:length]


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """Tokens start..end of the sequence's prompt and output, without joining the two: a decode step would
    otherwise copy every sequence's whole context to take its last token."""
    p = len(seq.prompt_ids)
    if end <= p:
        return seq.prompt_ids[start:end]
    if start >= p:
        return seq.output_ids[start - p : end - p]
    return seq.prompt_ids[start:] + seq.output_ids[: end - p]


@dataclass
class Scored:
    """Prompt tokens of one sequence whose logprobs a step makes, in order."""

    seq: Sequence
    targets: list[int]


def score(scored: list[Scored], logits: torch.Tensor) -> None:
    """Appends each prompt token's logprob, rank and its place's most likely tokens to its sequence's entries:
    `logits` [sum of targets, V], from the positions before the targets. The model's raw distribution, with -inf read
    as -9999, as vLLM reports prompt logprobs."""
    dev = logits.device
    with torch.inference_mode():
        lp = logits.log_softmax(dim=-1).clamp_(min=-9999.0)
        targets = to_device(dev, [t for s in scored for t in s.targets])
        chosen = lp.gather(1, targets[:, None])
        # vLLM's rank: how many tokens are at least as likely.
        ranks = (lp >= chosen).sum(dim=-1).tolist()
        k = max(s.seq.params.prompt_logprobs or 0 for s in scored)
        vals, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen_list, top_vals, top_ids = chosen[:, 0].tolist(), vals.tolist(), ids.tolist()
    row = 0
    for s in scored:
        n = s.seq.params.prompt_logprobs or 0
        for _ in s.targets:
            top = list(zip(top_ids[row][:n], top_vals[row][:n], strict=True))
            s.seq.prompt_logprobs.append(TokenLogprob(chosen_list[row], top, ranks[row]))
            row += 1
