"""What the API checks against a served model before a request becomes a job: the prompt's length against the
context, token ids against the vocabulary. A request refused here creates nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from chatq.core.adapters import Adapter
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.errors import BadRequest
from chatq.core.model_info import ModelInfo
from chatq.core.render import Renderer, bad_words_ids
from chatq.core.requests import GenerationRequest


@dataclass(frozen=True)
class ServedModel:
    """One model the API serves, built from its registry entry: its card, and the checks and rendering a request for
    it gets before it becomes a job."""

    info: ModelInfo
    created: int
    digest: str  # of the entry it was built from: a changed entry is loaded again
    renderer: Renderer = field(repr=False, compare=False)
    # The LoRA adapter a request named, served by this model's workers; None: the model itself.
    adapter: Adapter | None = None

    @classmethod
    def build(cls, info: ModelInfo, created: int, digest: str, trust_request_templates: bool = False) -> ServedModel:
        """`trust_request_templates`: CHATQ_TRUST_REQUEST_CHAT_TEMPLATE, whether a request may bring its own."""
        return cls(info, created, digest, Renderer(info, trust_request_templates=trust_request_templates))

    @property
    def name(self) -> str:
        """The model's name: its workers' queue, its metrics', its limits'."""
        return self.info.name

    @property
    def shown_name(self) -> str:
        """The name the request used: its adapter's, or the model's."""
        return self.adapter.name if self.adapter is not None else self.info.name

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        body.check()
        return self.admit(body, self.renderer.render(body).ids)

    def text_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """Each of the request's prompts as it will run."""
        body.check()
        return [self.admit(body, self.renderer.encode(p, body.add_special_tokens)) for p in body.prompts]

    def admit(self, body: GenerationRequest, prompt_ids: list[int]) -> list[int]:
        """Checks that need the tokenizer, the context length or the model's sampling defaults; returns the prompt as
        it will run."""
        body.check_greedy(self.info.sampling_defaults)
        prompt_ids = self._truncated(body, prompt_ids)
        self._check_lengths(body, len(prompt_ids))
        vocab = self.info.vocab_size
        body.check_vocab(vocab)
        bad_words_ids(self.renderer.tokenizer, body.bad_words)  # a word that makes no token is a 400 now
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
        param = body.max_tokens_param
        if (body.max_new_tokens or 0) > limit:
            raise BadRequest(
                f"{param} ({body.max_new_tokens}) must be at most the model's context length ({limit}).", param
            )
        room = limit - prompt_tokens
        if body.min_tokens > room:
            raise BadRequest(
                f"min_tokens ({body.min_tokens}) is more than the {room} tokens left after the prompt.", "min_tokens"
            )
