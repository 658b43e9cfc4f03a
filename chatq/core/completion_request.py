"""The legacy /v1/completions request body: a prompt, or a list of them, instead of messages."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from chatq.core.errors import BadRequest
from chatq.core.requests import MAX_PROMPTS, MAX_TOP_LOGPROBS, GenerationRequest


class CompletionRequest(GenerationRequest):
    """The legacy /v1/completions body: a prompt instead of messages."""

    # One prompt (text or token ids), or a batch of them: each gets its `n` choices, indexed in order.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    add_special_tokens: bool = True  # a text prompt gets the tokenizer's special tokens unless told otherwise

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        # A batch of one is that prompt (LangChain's OpenAI LLM always sends a list).
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            return v[0]
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: one, or each of a batch."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM makes them for an echo with logprobs too, `logprobs` of them: the echoed prompt's entries."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def scores_only(self) -> bool:
        # vLLM's way to score a prompt: its echo, and no generated token shown.
        return self.echo and self.max_tokens == 0

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"`logprobs` must be a value in the interval [0, {MAX_TOP_LOGPROBS}].", "logprobs")
        prompts = self.prompts
        if len(prompts) > MAX_PROMPTS:
            raise BadRequest(
                f"prompt list length {len(prompts)} exceeds the maximum allowed count of {MAX_PROMPTS}.", "prompt"
            )
        if len(prompts) * self.n > MAX_PROMPTS:
            # A job's choices all wait in one worker's queue, ahead of later jobs (as MAX_N bounds them).
            raise BadRequest(f"A batch may ask for at most {MAX_PROMPTS} choices in all (prompts times n).", "n")
        if any(not p for p in prompts):
            raise BadRequest("The prompt must not be empty.", "prompt")
