"""Per-sequence sampling over a batch of logits: every row keeps its own parameters, history and seed.

Order as in vLLM: a grammar masks what it forbids; logprobs are taken there (the model's distribution over what the
grammar allows); then allowed_token_ids, bad words, min_tokens, logit_bias and penalties shape the logits, and
temperature, top-k, top-p and min-p pick the candidates; last, a thinking budget that has run out forces its end
marker's next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from chatq.core.sampling import GREEDY_BELOW

if TYPE_CHECKING:
    from chatq.worker.grammar import GrammarState


@dataclass(frozen=True)
class ThinkingBudget:
    """vLLM's thinking_token_budget: once the open thought (what follows the last start marker that no end marker
    closed, in the prompt and the output) holds `tokens` tokens, the end marker's tokens are taken next, one a step."""

    tokens: int
    start: tuple[int, ...]  # the thought's start marker, as token ids
    end: tuple[int, ...]  # its end marker: what ends a thought, and what the budget forces


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    # Every id that ends the sequence: EOS (unless ignore_eos) and the request's stop_token_ids.
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the k most likely
    # None: none; k: each prompt token's logprob (but the first's), its rank and the k most likely at its place.
    prompt_logprobs: int | None = None
    logprob_ids: tuple[int, ...] = ()  # with logprobs: these ids' logprobs in place of the k most likely
    allowed_ids: tuple[int, ...] = ()  # empty: every token may be sampled
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose last token may not follow the rest
    # (min size, max size, count): the sequence ends once its output ends in a pattern of min..max tokens repeated
    # count times.
    repetition: tuple[int, int, int] | None = None
    thinking: ThinkingBudget | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def shapes_logits(self) -> bool:
        return bool(
            self.allowed_ids
            or self.bad_words
            or self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


@dataclass
class History:
    """What a penalized sequence has said, brought up to date with each new token, so a step's host time does not
    grow with the context as rebuilding it every step (as transformers' logits processors do) would."""

    counted: int = -1  # output ids taken in so far; -1: not built yet
    seen: set[int] = field(default_factory=set)  # prompt and output ids: repetition_penalty
    seen_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # the same, on the device
    said: set[int] = field(default_factory=set)  # output ids: presence and frequency penalties
    said_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    counts: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [V]: how often each id was output
    # A thinking budget's markers: prompt and output tokens looked through so far, and where the last start and the
    # last end marker begin (-1: none yet).
    marks_scanned: int = 0
    last_start: int = -1
    last_end: int = -1


@dataclass
class Row:
    """One sequence as the sampler sees it."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: GrammarState | None = None
    history: History = field(default_factory=History)


@dataclass
class TokenLogprob:
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
    rank: int | None = None  # among the vocabulary, 1 the most likely (given for a prompt token's)


def to_device(device: torch.device, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small tensor built on the host and copied without waiting: torch.tensor(..., device="cuda") blocks the
    host until the GPU has caught up, and the one host sync of a step is reading its sampled ids."""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)


def _shape(logits: torch.Tensor, rows: list[Row]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.shapes_logits:
            continue
        line, dev = logits[i], logits.device
        if p.allowed_ids:
            allowed = to_device(dev, list(p.allowed_ids))
            kept = line[allowed]  # a copy
            line.fill_(float("-inf"))
            line[allowed] = kept
        for word in p.bad_words:
            if _completes(row.output_ids, word):
                line[word[-1]] = float("-inf")
        if len(row.output_ids) < p.min_tokens and p.stop_token_ids:
            stops = to_device(dev, [t for t in p.stop_token_ids if t < vocab])
            allowed = line[stops]  # a copy
            line[stops] = float("-inf")
            if row.grammar is not None:
                # A complete grammar allows only a stop token: it wins over min_tokens, or no token would be left.
                # Decided on the device, without waiting for it.
                line[stops] = torch.where(torch.isneginf(line).all(), allowed, line[stops])
        if p.logit_bias:
            # Ids are checked against the vocabulary once more here: out of range, index_add_ on CUDA is a device
            # assert, which ends the process rather than raising for this row.
            bias = {t: v for t, v in p.logit_bias.items() if 0 <= t < vocab}
            line.index_add_(0, to_device(dev, list(bias)), to_device(dev, list(bias.values()), line.dtype))
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            h = _catch_up(row, line)
            if p.repetition_penalty != 1.0:
                rp, vals = p.repetition_penalty, line[h.seen_ids]
                line[h.seen_ids] = torch.where(vals > 0, vals / rp, vals * rp)
            if p.presence_penalty or p.frequency_penalty:
                said = h.said_ids
                line.index_add_(0, said, -(p.frequency_penalty * h.counts[said] + p.presence_penalty))


def _completes(output: list[int], word: tuple[int, ...]) -> bool:
    """Whether the word's last token would complete it: the output ends in the rest (vLLM's rule for bad words)."""
    rest = len(word) - 1
    return rest <= len(output) and (rest == 0 or tuple(output[-rest:]) == word[:-1])


def _catch_up(row: Row, line: torch.Tensor) -> History:
    """The row's history with every output id taken in: built on first use (or again if the output was cut back),
    after which only each step's new ids cost anything."""
    h, out, dev = row.history, row.output_ids, line.device
    if not 0 <= h.counted <= len(out):
        h.counted, h.seen, h.said = 0, set(row.prompt_ids), set()
        h.seen_ids, h.said_ids = to_device(dev, list(h.seen)), to_device(dev, [])
        h.counts = torch.zeros_like(line)
    new = out[h.counted :]
    if not new:
        return h
    if unseen := set(new) - h.seen:
        h.seen |= unseen
        h.seen_ids = torch.cat([h.seen_ids, to_device(dev, list(unseen))])
    if unsaid := set(new) - h.said:
        h.said |= unsaid
        h.said_ids = torch.cat([h.said_ids, to_device(dev, list(unsaid))])
    # Not bincount: on CUDA it reads its input's largest id back to size its output, a host sync.
    ids = to_device(dev, new)
    h.counts.index_add_(0, ids, torch.ones_like(ids, dtype=h.counts.dtype))
    h.counted = len(out)
    return h


def _truncate(scaled: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """min_p, then top_k, then top_p, each on what the one before kept: vLLM's order."""
    dev = scaled.device
    params = [r.params for r in rows]
    vocab = scaled.shape[-1]
    if any(p.min_p > 0 for p in params):
        min_p = to_device(dev, [p.min_p for p in params], scaled.dtype)
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if any(0 < p.top_k < vocab for p in params):  # a top_k of the vocabulary's size or more keeps every token
        k = to_device(dev, [p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = to_device(dev, [p.top_p for p in params], scaled.dtype)
        sorted_logits, order = scaled.sort(dim=-1)
        # Drop the tail with mass within 1 - top_p, summed from the bottom as vLLM does: from the top, float32
        # reaches 1 early and clips rows at top_p 1.
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
        drop[:, -1] = False
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def sample(logits: torch.Tensor, rows: list[Row]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [B, V] float32, modified in place. Returns one token id and its logprobs (if asked) per row.

    If any row fails, no bias or penalty stays added to any row (a grammar's mask may stay, and masking again
    changes nothing), so the caller can sample the rows again one by one."""
    dev = logits.device
    if any(r.grammar is not None for r in rows):
        from chatq.worker.grammar import apply_masks

        # First, as vLLM masks before its sampler: logprobs are then those of what the grammar allows.
        apply_masks(logits, [r.grammar for r in rows])
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    # Row indexes as device tensors: indexing with a list would copy it to the device and wait.
    want_rows = to_device(dev, want) if want else None
    # A token the grammar forbids reads -9999, vLLM's floor: JSON has no -inf.
    raw = logits[want_rows].log_softmax(dim=-1).clamp_(min=-9999.0) if want_rows is not None else None
    shaping = [i for i, r in enumerate(rows) if r.params.shapes_logits]
    shaping_rows = to_device(dev, shaping) if shaping else None
    unshaped = logits[shaping_rows] if shaping_rows is not None else None  # a copy
    try:
        _shape(logits, rows)
        tokens = _pick(logits, rows)
    except Exception:
        if unshaped is not None:
            logits[shaping_rows] = unshaped
        raise
    forced = {i: t for i, r in enumerate(rows) if r.params.thinking is not None and (t := _forced(r)) is not None}
    if forced:
        # After the draw, so a seeded row's generator moves as it would have, and a continued job draws the same.
        tokens[to_device(dev, list(forced))] = to_device(dev, list(forced.values()))
    ids = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    if raw is not None and want_rows is not None:
        k = max(0 if rows[i].params.logprob_ids else rows[i].params.logprobs or 0 for i in want)
        vals, top = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
        chosen = raw.gather(1, tokens[want_rows][:, None])[:, 0].tolist()
        top_vals, top_ids = vals.tolist(), top.tolist()
        for j, i in enumerate(want):
            p = rows[i].params
            if p.logprob_ids:
                logprobs[i] = _named(raw[j], ids[i], chosen[j], p.logprob_ids)
                continue
            n = p.logprobs or 0
            logprobs[i] = TokenLogprob(chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n], strict=True)))
    return ids, logprobs


def _named(raw: torch.Tensor, token: int, logprob: float, named: tuple[int, ...]) -> TokenLogprob:
    """The logprobs of the sampled token and then of each named id, each once, as vLLM lists them for
    logprob_token_ids."""
    others = [t for t in dict.fromkeys(named) if t != token]
    values = raw[to_device(raw.device, others)].tolist() if others else []
    return TokenLogprob(logprob, [(token, logprob), *zip(others, values, strict=True)])


def _forced(row: Row) -> int | None:
    """The token a thinking budget forces next, if it does: the end marker's next token, once the open thought has
    its budget of tokens (vLLM's rule, counting the prompt's tokens after a start marker it ends with). A row that
    a grammar holds is past its thought."""
    budget = row.params.thinking
    if budget is None or row.grammar is not None:
        return None
    h, prompt, out = row.history, row.prompt_ids, row.output_ids
    total = len(prompt) + len(out)

    def at(i: int) -> int:
        return prompt[i] if i < len(prompt) else out[i - len(prompt)]

    def marks(i: int, marker: tuple[int, ...]) -> bool:
        return i + len(marker) <= total and all(at(i + j) == t for j, t in enumerate(marker))

    if h.marks_scanned > total:  # the output was cut back: look again from the start
        h.marks_scanned, h.last_start, h.last_end = 0, -1, -1
    longest = max(len(budget.start), len(budget.end))
    for i in range(max(0, h.marks_scanned - longest + 1), total):
        if marks(i, budget.start):
            h.last_start = i
        if marks(i, budget.end):
            h.last_end = i
    h.marks_scanned = total
    if h.last_start < 0 or h.last_start <= h.last_end or total - h.last_start - len(budget.start) < budget.tokens:
        return None
    # Continue an end marker already begun at the tail (forced in earlier steps, or written by the model).
    begun = max((k for k in range(1, len(budget.end)) if marks(total - k, budget.end[:k])), default=0)
    return budget.end[begun]


def skip_draws(generator: torch.Generator, tokens: int, vocab: int) -> None:
    """Advances a seeded row's generator past the draws `_pick` made for `tokens` sampled tokens: a sequence taken up
    with output already (a job continued on another worker) then samples what it would have sampled."""
    noise = torch.empty(vocab, device=generator.device)
    for _ in range(tokens):
        noise.exponential_(generator=generator)


def _pick(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    dev = logits.device
    if all(r.params.greedy for r in rows):
        return _first_max(logits)
    greedy = to_device(dev, [r.params.greedy for r in rows], torch.bool)
    temps = to_device(dev, [max(r.params.temperature, GREEDY_BELOW) for r in rows], logits.dtype)
    probs = _truncate(logits / temps[:, None], rows).softmax(dim=-1)
    # Exponential race: argmax of p / Exp(1) is a multinomial draw, and seeded rows draw noise from their own
    # generator, so a seed's text is independent of the batch.
    noise = torch.empty_like(probs).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i].exponential_(generator=r.generator)
    return torch.where(greedy, _first_max(logits), _first_max(probs / noise))


def _first_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first where values tie (torch.max, the faster of the two on CPU: docs/performance.md)."""
    return x.max(dim=-1).indices
