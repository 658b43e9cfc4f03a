"""A job's choice: one engine sequence and what the job run made of its tokens; and the shapes a choice's output
takes beside its text: the echo (with its prompt's logprobs in a legacy answer), vLLM's prompt_logprobs, its token
ids, its tool calls' ids."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.chunks import TokenInfo
from chatq.core.completion_request import CompletionRequest
from chatq.core.delta import Delta
from chatq.core.job import Job
from chatq.worker.detokenize import Decoder, TextStream
from chatq.worker.engine import Sequence
from chatq.worker.grammar import Grammar
from chatq.worker.parse import JoinedDeltas, Parser


@dataclass
class Choice:
    index: int
    seq: Sequence
    text: TextStream
    parser: Parser
    prompt: int = 0  # which of the job's prompts it answers
    echo: str = ""  # the text it echoes first
    echo_pending: bool = False  # its echo waits for the prompt's logprobs, which come with its first token
    message: JoinedDeltas = field(default_factory=JoinedDeltas)
    logprobs: list[TokenInfo] = field(default_factory=list)
    unsent_logprobs: list[TokenInfo] = field(default_factory=list)
    reasoning_tokens: int = 0
    grammar: Grammar | None = None  # the output's format, until its sequence takes it on once the reasoning ends
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    unlogged: list[int] = field(default_factory=list)  # token ids generated since the choice's last event
    prompt_ids_sent: bool = False  # a legacy stream's first chunk of the choice carries the prompt's ids
    held: Delta = field(default_factory=Delta)  # what a job answering at its end has made of it so far
    score: float = 0.0  # its cumulative logprob, which best_of ranks by


def echo_text(req: ChatCompletionRequest | CompletionRequest, p: int, prompt_ids: list[int], decoder: Decoder) -> str:
    """The text the choices of prompt `p` echo."""
    if isinstance(req, ChatCompletionRequest):
        last = req.messages[-1]
        return (last.text() or "") if req.echo and last.role == req.response_role else ""
    # The prompt as sent, as vLLM echoes it; decoded only when it came as ids or was truncated.
    prompt = req.prompts[p]
    if not req.echo:
        return ""
    if isinstance(prompt, str) and req.truncate_prompt_tokens is None:
        return prompt
    return decoder.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def echo_with_logprobs(choice: Choice, decoder: Decoder) -> Delta:
    """The echo of a legacy choice, with its prompt's logprobs as vLLM lists them: the first token's null, then
    each token's with the likeliest at its place, `logprobs` of them besides the token itself."""
    choice.echo_pending = False
    ids, entries, k = choice.seq.prompt_ids, choice.seq.prompt_logprobs, choice.seq.params.logprobs or 0
    first = decoder.token(ids[0])
    infos = [TokenInfo(first, None, [], 0)]
    offset = len(first)
    for token, e in zip(ids[1:], entries, strict=True):
        info = decoder.info(token, e.logprob, [(t, lp) for t, lp in e.top if t != token][:k], offset)
        infos.append(info)
        offset += len(info.token)
    choice.unsent_logprobs = infos + choice.unsent_logprobs
    echo = Delta(content=choice.echo)
    choice.message.add(echo)
    return echo


def prompt_logprobs(seq: Sequence, decoder: Decoder) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: null for the first token, then for each a map of token id to its logprob, rank and
    text, the prompt's token first and the likeliest after it."""
    out: list[dict[str, Any] | None] = [None]
    # Fewer than the prompt's only where the job ended before its prompt was read (cancelled, failed).
    for token, e in zip(seq.prompt_ids[1:], seq.prompt_logprobs, strict=False):
        ranked = [(token, e.logprob, e.rank)] + [(t, lp, r) for r, (t, lp) in enumerate(e.top, 1)]
        entry: dict[str, Any] = {}
        for t, lp, rank in ranked:
            entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": decoder.token(t)})
        out.append(entry)
    return out


def add_ids(job: Job, choice: Choice, data: dict[str, Any], ids: list[int]) -> None:
    """return_token_ids, where vLLM streams them: a chunk's token ids in its choice; the prompt's in the first
    chunk of a legacy choice (a chat stream's opening chunks carry them, from start())."""
    data["token_ids"] = ids
    if job.kind == "text" and not choice.prompt_ids_sent:
        data["prompt_token_ids"] = job.prompts[choice.prompt]
        choice.prompt_ids_sent = True


def call_id(job_id: str, choice: Choice, index: int) -> str:
    """A tool call's id, the same in every attempt at the job: a resumed job's result names the calls its
    stream named."""
    digest = hashlib.blake2b(f"{job_id}/{choice.index}/{index}".encode(), digest_size=16).hexdigest()
    return f"chatcmpl-tool-{digest}"
