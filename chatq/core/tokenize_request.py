"""The /tokenize and /detokenize request bodies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from chatq.core.chat_request import Message, Tool


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # by default, as the completion would be: on for a prompt, off for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # What the chat template sees besides the messages, so the count is the completion's prompt_tokens.
    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
