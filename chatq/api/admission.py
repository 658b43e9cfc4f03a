"""What the API checks against the served model before a request becomes a job: its name, the prompt's length
against the context, token ids against the vocabulary. A request refused here creates nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cached_property
from typing import TypeVar

import anyio

from chatq.core.errors import BadRequest, ModelNotFound, ServiceUnavailable
from chatq.core.model_info import ModelInfo
from chatq.core.render import Renderer
from chatq.core.requests import ChatCompletionRequest, CompletionRequest, GenerationRequest
from chatq.core.settings import Settings

T = TypeVar("T")


class ServedModel:
    """The model this API serves, read lazily: the API may start before a worker has converted its files."""

    def __init__(self, settings: Settings):
        self.name = settings.model_name
        self.settings = settings
        self.created = int(time.time())
        # Rendering and tokenizing run in threads, so a long prompt costs its own request time, not the event
        # loop's; bounded, so many at once queue here rather than take every core.
        self.limiter = anyio.CapacityLimiter(settings.render_threads)

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in one of the render threads."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    @cached_property
    def info(self) -> ModelInfo:
        path = self.settings.model_dir
        if not (path / "tokenizer.json").exists():
            raise ServiceUnavailable(f"The files of model `{self.name}` are not available yet.")
        return ModelInfo.read(self.name, path, self.settings.max_model_len)

    @cached_property
    def renderer(self) -> Renderer:
        return Renderer(self.info)

    def resolve(self, name: str | None) -> str:
        """The model a request names (none: this one)."""
        if name and name != self.name:
            raise ModelNotFound(name)
        return self.name

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        body.check()
        self.resolve(body.model)
        return self.admit(body, self.renderer.render(body).ids)

    def text_prompt(self, body: CompletionRequest) -> list[int]:
        body.check()
        self.resolve(body.model)
        return self.admit(body, self.renderer.encode(body.prompt, body.add_special_tokens))

    def admit(self, body: GenerationRequest, prompt_ids: list[int]) -> list[int]:
        """Checks that need the tokenizer or the context length; returns the prompt as it will run."""
        prompt_ids = self._truncated(body, prompt_ids)
        self._check_lengths(body, len(prompt_ids))
        vocab = self.info.vocab_size
        body.check_bias(vocab)
        if any(t >= vocab for t in body.stop_token_ids or []):
            raise BadRequest(f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise BadRequest(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        return prompt_ids

    def _truncated(self, body: GenerationRequest, prompt_ids: list[int]) -> list[int]:
        if body.truncate_prompt_tokens is None:
            return prompt_ids
        limit = self.info.max_model_len
        keep = limit if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        if keep > limit:
            raise BadRequest(
                f"truncate_prompt_tokens ({keep}) cannot be greater than the model's context length ({limit}).",
                "truncate_prompt_tokens",
            )
        return prompt_ids[-keep:]

    def _check_lengths(self, body: GenerationRequest, prompt_tokens: int) -> None:
        limit = self.info.max_model_len
        if prompt_tokens >= limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{prompt_tokens} input tokens, leaving no room for the completion. Please reduce the length of "
                "the messages or the prompt.",
                "input_tokens",
            )
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        if (body.max_new_tokens or 0) > limit:
            raise BadRequest(
                f"{param} ({body.max_new_tokens}) must be at most the model's context length ({limit}).", param
            )
        room = limit - prompt_tokens
        if body.min_tokens > room:
            raise BadRequest(
                f"min_tokens ({body.min_tokens}) is more than the {room} tokens left after the prompt.", "min_tokens"
            )
