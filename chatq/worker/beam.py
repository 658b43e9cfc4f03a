"""Beam search: which continuations of a job's beams survive each step, and which finish, chosen as transformers'
`generate(num_beams=...)` chooses them (its `_beam_search`, for one prompt), in float32 as it computes, so that the
answer is its answer token for token.

The engine feeds each step's next-token log-probabilities of the running beams and moves the beams' KV blocks as
`advance` says: beams are engine sequences that fork their parents' blocks, sharing the prefix and copying only a
last, partly filled block, so a step costs one decode per beam rather than the recomputation of a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from chatq.worker.engine import Sequence

_FAR = -1.0e9  # transformers' score for what may not be chosen


@dataclass
class Hypothesis:
    tokens: list[int]  # the generated tokens, its end token included
    score: float  # cumulative log-probability over length ** length_penalty
    ended: bool  # by an end token, not by the token limit


@dataclass
class Advance:
    """One step's outcome: for each beam slot, the beam (index into the rows given) it continues and its new token;
    or, once the search is over, its answer, best first."""

    parents: list[int]
    tokens: list[int]
    answer: list[Hypothesis] | None = None


class BeamSearch:
    def __init__(
        self,
        width: int,
        *,
        length_penalty: float,
        early_stopping: bool | Literal["never"],
        end_ids: frozenset[int],
        max_tokens: int,
    ):
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        # As many candidates as make sure `width` of them do not end, whatever the end tokens take.
        self.keep = max(2, 1 + len(end_ids)) * width
        self.end_ids = torch.tensor(sorted(end_ids), dtype=torch.long)
        self.max_tokens = max_tokens
        self.generated = 0  # tokens each running beam holds
        self.scores = torch.zeros(1, dtype=torch.float32)  # the running beams' cumulative log-probabilities
        self.finished: list[Hypothesis] = []  # the best `width` so far, best first
        self.improvable = True  # whether a running beam may still beat the worst finished one

    def advance(self, logprobs: torch.Tensor, outputs: list[list[int]]) -> Advance:
        """logprobs: [beams, vocab] float32 log-softmax of the running beams' next token (one beam at the first
        step); outputs: those beams' generated tokens."""
        vocab = logprobs.shape[1]
        total = (logprobs.cpu() + self.scores[:, None]).reshape(-1)
        top, index = torch.topk(total, k=min(self.keep, total.numel()))
        parents, tokens = (index // vocab).tolist(), (index % vocab).tolist()
        length = self.generated + 1
        ends = torch.isin(index % vocab, self.end_ids) | (length >= self.max_tokens)
        running = top + ends.to(torch.float32) * _FAR
        chosen = torch.topk(running, k=min(self.width, running.numel()))[1]
        self._update_finished(top, ends, parents, tokens, outputs, length)
        self.scores = running[chosen]
        self.generated = length
        self._check_improvable()
        all_finished = len(self.finished) == self.width
        open_beam = not (all_finished and self.early_stopping is True)
        if not (self.improvable and open_beam and not bool(ends.all())):
            return Advance([], [], self.finished)
        picked = chosen.tolist()
        return Advance([parents[j] for j in picked], [tokens[j] for j in picked])

    def _update_finished(
        self,
        top: torch.Tensor,
        ends: torch.Tensor,
        parents: list[int],
        tokens: list[int],
        outputs: list[list[int]],
        length: int,
    ) -> None:
        """Only candidates among the best `width` of the step finish, and only while they can still count."""
        full = len(self.finished) == self.width and self.early_stopping is True
        if full or not self.improvable:
            return
        scores = (top / (length**self.length_penalty)).tolist()
        for j in range(min(self.width, len(tokens))):
            if ends[j]:
                ended = tokens[j] in self.end_ids.tolist()
                self.finished.append(Hypothesis(outputs[parents[j]] + [tokens[j]], scores[j], ended))
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def _check_improvable(self) -> None:
        """transformers' heuristic: the best running beam, at its length (or at the limit for early_stopping
        "never" with a positive length_penalty), against the worst finished hypothesis once `width` have finished."""
        if len(self.finished) < self.width:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.generated
        best = (self.scores[:1] / (best_length**self.length_penalty)).item()
        worst = torch.tensor(self.finished[-1].score, dtype=torch.float32).item()
        self.improvable = self.improvable and best > worst


@dataclass(eq=False)
class BeamGroup:
    """A job's beams in the engine: `seqs` are its slots (the first runs alone until the first step forks it), `rows`
    the log-probabilities of those that have stepped, until every running one has."""

    search: BeamSearch
    seqs: list[Sequence] = field(default_factory=list)
    running: int = 1
    rows: dict[str, torch.Tensor] = field(default_factory=dict)

    def ready(self) -> bool:
        return all(s.id in self.rows for s in self.seqs[: self.running])
