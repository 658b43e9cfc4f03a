"""What sampling means on both sides: the API's validation of a request and the worker's sampler. No dependencies, so
the engine runs where only torch is installed."""

from __future__ import annotations

# Below it, sampling takes the most likely token: the API refuses n > 1 there, and the worker's sampler picks the
# argmax rather than divide by a temperature near zero.
GREEDY_BELOW = 1e-5

# OpenAI's values (vLLM's _DEFAULT_SAMPLING_PARAMS): what a field is when neither the request nor the served model's
# defaults set it.
OPENAI_DEFAULTS: dict[str, float] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}


def effective(requested: dict[str, float | None], defaults: dict[str, float]) -> dict[str, float]:
    """The sampling fields as a job runs them: the request's own value, else the served model's default (its
    generation config, chatq.core.model_info), else OpenAI's, as vLLM resolves them."""
    return {
        name: value if (value := requested.get(name)) is not None else defaults.get(name, fallback)
        for name, fallback in OPENAI_DEFAULTS.items()
    }


def max_tokens(requested: int | None, defaults: dict[str, float], room: int) -> int:
    """The job's token limit: the request's, else the served model's default, never more than the context's room."""
    limit = requested if requested is not None else defaults.get("max_tokens")
    return room if limit is None else min(int(limit), room)
