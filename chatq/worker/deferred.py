"""A job that answers at its end, once every candidate has ended: beam search, `n` beams wide, and best_of, the
best `n` of so many sampled. The beams' search, and the candidates ranked, each prompt's best `n` first."""

from __future__ import annotations

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.job import Job
from chatq.worker.beam import BeamGroup, BeamSearch
from chatq.worker.choice import Choice


def beam_group(req: ChatCompletionRequest | CompletionRequest, end_ids: frozenset[int], max_tokens: int) -> BeamGroup:
    """The search the beams of one prompt share: `n` wide, each ending at one of `end_ids` or at `max_tokens`."""
    search = BeamSearch(
        req.n,
        length_penalty=req.length_penalty,
        early_stopping=req.early_stopping,
        end_ids=end_ids,
        max_tokens=max_tokens,
    )
    return BeamGroup(search)


def rank(choices: list[Choice], job: Job) -> list[Choice]:
    """The candidates with each prompt's best `n` first, numbered as its choices (a beam search's come best first;
    best_of's rank by cumulative logprob), and the others after them, which count in the usage alone."""
    n, answered, others = job.request.n, [], []
    for p in range(len(job.prompts)):
        candidates = [c for c in choices if c.prompt == p]
        if not job.request.use_beam_search:
            candidates.sort(key=lambda c: c.score, reverse=True)
        answered += candidates[:n]
        others += candidates[n:]
    ranked = answered + others
    for i, c in enumerate(ranked):
        c.index = i
    return ranked
