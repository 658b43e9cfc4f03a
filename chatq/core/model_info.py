"""A model's facts, read from its directory in one place: the worker generates with them and registers them in Redis
(chatq.core.registry), where the API reads them to validate and render requests, so both agree on every limit."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from chatq.core.lora_format import LoraSpec

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# The generation_config fields vLLM reads as the model authors' sampling defaults, for what a request leaves out.
SAMPLING_DEFAULTS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int  # rows of the logits, maybe more than the tokenizer's vocabulary
    chat_templates: dict[str, str]  # name -> jinja source; always "default", maybe "tool_use"
    special_tokens: dict[str, str | None]  # the variables of that name the chat template sees
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict[str, float]  # `max_new_tokens` read as `max_tokens`, as vLLM reads it
    tokenizer: Tokenizer = field(repr=False, compare=False)
    lora: LoraSpec | None = None  # the adapters its workers take; None: none

    @classmethod
    def read(
        cls,
        name: str,
        path: Path,
        max_model_len: int = 0,
        chat_template: str = "",
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
    ) -> ModelInfo:
        """`max_model_len` (CHATQ_MAX_MODEL_LEN) overrides the config's; 0 takes the config's. `chat_template`
        (CHATQ_CHAT_TEMPLATE), a file's path or a template, replaces the model's own; empty keeps them. The last two
        are CHATQ_GENERATION_CONFIG and CHATQ_OVERRIDE_GENERATION_CONFIG (see `sampling_defaults`)."""
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _json(path / "config.json")
        tokenizer_config = _json(path / "tokenizer_config.json")
        generation = _json(path / "generation_config.json")
        special = {k: _token_text(tokenizer_config.get(k)) for k in SPECIAL_TOKENS}
        return cls(
            name=name,
            max_model_len=max_model_len or _context_length(config, path),
            vocab_size=int(config.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True)),
            chat_templates={"default": _template_source(chat_template)}
            if chat_template
            else _chat_templates(path, tokenizer_config),
            special_tokens=special,
            eos_token_ids=_eos_ids(generation, tokenizer, special["eos_token"]),
            sampling_defaults=sampling_defaults(
                _defaults_source(generation_config, path, generation), override_generation_config or {}
            ),
            tokenizer=tokenizer,
        )


def sampling_defaults(generation_config: dict[str, Any], override: dict[str, Any]) -> dict[str, float]:
    """The sampling fields a generation config sets, `override` over them, as vLLM's get_diff_sampling_param reads
    them: `max_new_tokens` becomes `max_tokens`."""
    merged = generation_config | override
    found = {k: merged[k] for k in SAMPLING_DEFAULTS if merged.get(k) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found


def _defaults_source(setting: str, path: Path, generation: dict[str, Any]) -> dict[str, Any]:
    """The generation config the defaults come from: the model's ("auto"), none ("vllm"), or a folder's."""
    if setting == "auto":
        return generation
    if setting == "vllm":
        return {}
    folder = Path(setting).expanduser()
    if not (folder / "generation_config.json").exists():
        raise RuntimeError(f"CHATQ_GENERATION_CONFIG: {folder} holds no generation_config.json")
    return _json(folder / "generation_config.json")


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token: Any) -> str | None:
    return token["content"] if isinstance(token, dict) else token


def _context_length(config: dict[str, Any], path: Path) -> int:
    if "max_position_embeddings" not in config:
        raise RuntimeError(f"{path}/config.json names no max_position_embeddings: set CHATQ_MAX_MODEL_LEN")
    return int(config["max_position_embeddings"])


def _chat_templates(path: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """Some models ship several named templates ([{"name": "default", ...}, {"name": "tool_use", ...}])."""
    template = tokenizer_config.get("chat_template")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text()
    if template is None:
        raise RuntimeError(f"{path} has no chat template")
    named = {t["name"]: t["template"] for t in template} if isinstance(template, list) else {"default": template}
    if "default" not in named:
        raise RuntimeError(f"{path} names chat templates but none `default`: {sorted(named)}")
    return named


def _template_source(setting: str) -> str:
    """A chat template setting's template: the file it names, else the setting itself if it reads as a template, as
    vLLM reads --chat-template."""
    try:
        return Path(setting).read_text()
    except (OSError, ValueError):
        if not any(c in setting for c in "{}\n"):
            raise RuntimeError(f"CHATQ_CHAT_TEMPLATE names no readable file, nor is it a template: {setting}") from None
        return setting


def _eos_ids(generation: dict[str, Any], tokenizer: Tokenizer, eos_token: str | None) -> tuple[int, ...]:
    """generation_config's EOS ids, and the tokenizer's own EOS token."""
    eos = generation.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if eos_token is not None and (tid := tokenizer.token_to_id(eos_token)) is not None and tid not in ids:
        ids.append(tid)
    return tuple(ids)
