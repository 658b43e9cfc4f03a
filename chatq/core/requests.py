"""What chat and legacy completion requests share: the generation fields, their limits and checks, and the fields
refused by name (chatq.core.chat_request and chatq.core.completion_request add each endpoint's own)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, get_args

from annotated_types import Interval
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chatq.core.errors import BadRequest
from chatq.core.formats import ResponseFormat, StructuredOutputs, check_structural_tag, json_text
from chatq.core.sampling import GREEDY_BELOW, OPENAI_DEFAULTS, effective
from chatq.core.schemas import check_regex, check_schema, size_problem


def _nullable(annotation: Any) -> bool:
    return annotation is None or type(None) in get_args(annotation)


class StreamOptions(BaseModel):
    include_usage: bool | None = False  # null: left out, as vLLM reads it
    continuous_usage_stats: bool | None = False


# Fields chatq does not honour, with the value that asks for nothing (as null and empty do, and false where it is
# null): any other is a 400, never ignored.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "audio": None,
    "modalities": ["text"],
    "prediction": None,
    "web_search_options": None,
    "functions": None,
    "function_call": None,
    "suffix": None,
    "spaces_between_special_tokens": True,
    "truncation_side": "left",  # truncate_prompt_tokens keeps the prompt's end
    "stream_interval": 1,
    "logits_processors": None,
    "structural_tag": None,
    # vLLM's older names for structured outputs, which chatq takes as `structured_outputs` only.
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "vllm_xargs": None,
    "watermarking": None,
    "routed_experts_prompt_start": 0,
    "return_prompt_text": None,
    "prompt_embeds": None,
}
# Names some clients send for vLLM's repetition detection, which takes them inside `repetition_detection`: refused by
# name rather than ignored, so a client learns where they go.
MISPLACED_FIELDS = {
    "max_repetition_pattern_size": "repetition_detection.max_pattern_size",
    "min_repetition_pattern_size": "repetition_detection.min_pattern_size",
    "repetition_min_count": "repetition_detection.min_count",
}
MAX_TOP_LOGPROBS = 20
# vLLM's limit on a legacy request's list of prompts (VLLM_MAX_COMPLETION_PROMPTS).
MAX_PROMPTS = 1024
# vLLM's limits: the ids one request may ask logprobs of, and the token sequences its bad words may make.
MAX_LOGPROB_TOKEN_IDS = 128
MAX_BAD_WORDS = 128
# OpenAI's limit. vLLM sets none, but one request's choices all wait in one worker's queue, ahead of later jobs.
MAX_N = 128
# Bounds on a request's lists, so a body within CHATQ_MAX_BODY_BYTES still renders in bounded time: far above what a
# conversation or a tool set needs. (`stop` holds at most 4 strings, OpenAI's limit.)
MAX_MESSAGES = 4096
MAX_TOOLS = 1024
MAX_STOP = 4


class RepetitionDetection(BaseModel):
    """vLLM's repetition detection: the output ends, finish_reason "repetition", once its last tokens are a pattern of
    min_pattern_size..max_pattern_size tokens repeated min_count times."""

    max_pattern_size: int = 0  # 0: off
    min_pattern_size: int = 0  # 0: 1
    min_count: int = 0

    @model_validator(mode="after")
    def _consistent(self) -> RepetitionDetection:
        # vLLM's rules and words; a ValueError here is a 400 naming the field.
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= max_pattern_size. "
                "Set both to 0 to disable repetitive pattern detection."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                "min_count must be >= 2 to detect repetitive patterns in engine output. If you do not wish to "
                "detect repetitive patterns, set max_pattern_size to 0."
            )
        return self


class Range:
    """A field's allowed values, declared once: pydantic writes them into the OpenAPI schema (generated clients and
    fuzzers read them there) and check() refuses a value outside them with `message`, worded as vLLM words it."""

    def __init__(self, message: str, **bounds: Any):
        self.message = message
        self.bounds = bounds  # JSON schema keywords: minimum, maximum, exclusiveMinimum, items

    def __call__(self, schema: dict[str, Any]) -> None:
        """Pydantic's json_schema_extra hook."""
        schema.update(self.bounds)

    def check(self, value: Any, param: str) -> None:
        if not _within(value, self.bounds):
            raise BadRequest(self.message, param)

    def interval(self) -> Interval:
        """The bounds as a constraint pydantic validates, for a model that refuses a value outside them itself."""
        b = self.bounds
        return Interval(ge=b.get("minimum"), le=b.get("maximum"), gt=b.get("exclusiveMinimum"))


def _within(value: Any, bounds: dict[str, Any]) -> bool:
    if value is None:
        return True
    if "items" in bounds:
        return all(_within(v, bounds["items"]) for v in value)
    low, high, above = bounds.get("minimum"), bounds.get("maximum"), bounds.get("exclusiveMinimum")
    return (low is None or value >= low) and (high is None or value <= high) and (above is None or value > above)


def bounded(default: Any, allowed: Range) -> Any:
    """A field whose range the OpenAPI schema states and check() checks."""
    return Field(default, json_schema_extra=allowed)


def token_limit(param: str) -> Range:
    """The range of max_tokens and max_completion_tokens, with `param` named in its message."""
    return Range(f"{param} must be at least 1", minimum=1)


# vLLM's limits on a cache_salt.
MAX_CACHE_SALT = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(salt: str | None) -> None:
    """A cache_salt is a non-empty string of at most 128 characters, none of @ / \\ or NUL, as vLLM takes one."""
    if salt is None:
        return
    if not salt:
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > MAX_CACHE_SALT or not CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise BadRequest(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


class GenerationRequest(BaseModel):
    """Fields shared by chat and legacy text completions: how to sample and how to stream."""

    # Unknown keys are accepted and ignored, as in vLLM; the known-but-unsupported ones are refused in check().
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    background: bool = False

    max_tokens: int | None = bounded(None, token_limit("max_tokens"))
    temperature: float | None = bounded(None, Range("temperature must be in [0, 2]", minimum=0, maximum=2))
    top_p: float | None = bounded(None, Range("top_p must be in (0, 1]", exclusiveMinimum=0, maximum=1))
    top_k: int | None = bounded(None, Range("top_k must be -1 (disable), 0 (disable) or at least 1", minimum=-1))
    min_p: float | None = bounded(None, Range("min_p must be in [0, 1]", minimum=0, maximum=1))
    seed: int | None = bounded(None, Range("seed must be a 64-bit integer", minimum=-(2**63), maximum=2**63 - 1))
    stop: list[str] = Field(default_factory=list)  # a single string is accepted and wrapped
    stop_token_ids: list[int] | None = bounded(
        None, Range("stop_token_ids must be token ids", items={"type": "integer", "minimum": 0})
    )
    include_stop_str_in_output: bool = False
    n: int = bounded(1, Range(f"n must be in [1, {MAX_N}]", minimum=1, maximum=MAX_N))
    # The sampling fields left None take the served model's defaults (chatq.core.sampling.effective).
    presence_penalty: float | None = bounded(None, Range("presence_penalty must be in [-2, 2]", minimum=-2, maximum=2))
    frequency_penalty: float | None = bounded(
        None, Range("frequency_penalty must be in [-2, 2]", minimum=-2, maximum=2)
    )
    repetition_penalty: float | None = bounded(
        None, Range("repetition_penalty must be greater than zero", exclusiveMinimum=0)
    )
    logit_bias: dict[str, float] | None = None
    min_tokens: int = bounded(0, Range("min_tokens must be at least 0", minimum=0))
    ignore_eos: bool = False
    echo: bool = False
    # Each prompt token's logprob (but the first's) and the k likeliest at its place; -1 would be the whole vocabulary.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None
    request_id: str | None = None
    priority: int = 0
    # Partitions the prefix cache further within the API key's partition: only requests with the same salt share
    # cached prompt blocks.
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Beam search, `n` beams wide; and best_of, the best n of so many sampled, by cumulative logprob.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    best_of: int | None = bounded(None, Range(f"best_of must be in [1, {MAX_N}]", minimum=1, maximum=MAX_N))
    # Token filters, as vLLM applies them after the logprobs are taken: only these ids may be sampled; these words
    # may not be completed (see chatq.core.render.bad_words_ids).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    repetition_detection: RepetitionDetection | None = None
    # Logprobs of exactly these ids (and the sampled one) at each position, in place of the most likely ones.
    logprob_token_ids: list[int] | None = None
    return_token_ids: bool | None = None  # the prompt's and each choice's token ids, beside the text
    return_tokens_as_token_ids: bool | None = None  # logprob entries name tokens as "token_id:N"

    # Tokens a thought may take before its end is forced, with a reasoning parser (vLLM's); None or -1: no limit.
    thinking_token_budget: int | None = Field(default=None, ge=0)

    @field_validator("thinking_token_budget", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> Any:
        # vLLM's rule: an integer (not a bool or a float), -1 for no limit.
        if v is not None and (isinstance(v, (bool, float)) or not isinstance(v, int) or v < -1):
            raise ValueError("`thinking_token_budget` must be a non-negative integer or -1 for unlimited.")
        return None if v == -1 else v

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """null for a field that cannot be null reads as the field left out, as OpenAI and vLLM read it: the SDKs
        send null for a parameter passed as None."""
        if isinstance(data, dict) and None in data.values():
            fixed = cls._fixed_fields()
            return {k: v for k, v in data.items() if v is not None or k not in fixed}
        return data

    @classmethod
    def _fixed_fields(cls) -> frozenset[str]:
        """Fields with a default whose type excludes None."""
        return frozenset(
            name for name, f in cls.model_fields.items() if not f.is_required() and not _nullable(f.annotation)
        )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if isinstance(stops, list):
            if len(stops) > MAX_STOP:
                raise ValueError(f"stop may hold at most {MAX_STOP} sequences")
            if any(s == "" for s in stops):
                raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def max_tokens_param(self) -> str:
        """The field whose token limit counts (chat's max_completion_tokens wins over the deprecated max_tokens)."""
        return "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        value: int | None = getattr(self, self.max_tokens_param)
        return value

    def sampling(self, defaults: dict[str, float]) -> dict[str, float]:
        """The sampling fields as the job runs them, under the served model's `defaults`."""
        return effective({name: getattr(self, name) for name in OPENAI_DEFAULTS}, defaults)

    def check_greedy(self, defaults: dict[str, float]) -> None:
        """n > 1 and best_of > 1 need sampling (beam search needs none), whether the request's temperature or the
        model's default makes it greedy."""
        if self.use_beam_search or self.sampling(defaults)["temperature"] >= GREEDY_BELOW:
            return
        if self.n > 1:
            raise BadRequest("n must be 1 when using greedy sampling", "n")
        if (self.best_of or 1) > 1:
            raise BadRequest("best_of must be 1 when using greedy sampling", "best_of")

    def check(self) -> None:
        """Checks beyond single-field types; raises BadRequest naming the offending param."""
        extra = self.model_extra or {}
        for name, harmless in UNSUPPORTED_FIELDS.items():
            value = extra.get(name)
            asks_nothing = value in (None, [], {}) or value == harmless or harmless is None and value is False
            if not asks_nothing:
                raise BadRequest(f"`{name}` is not supported by this server", name)
        for name, place in MISPLACED_FIELDS.items():
            if extra.get(name) is not None:
                message = f"`{name}` is not a field of this server: vLLM's repetition detection is `{place}`."
                raise BadRequest(message, name)

        def need(ok: bool, message: str, param: str) -> None:
            if not ok:
                raise BadRequest(message, param)

        for name, allowed in self._ranges():
            allowed.check(getattr(self, name), name)
        self.check_greedy({})
        self._check_best_of()
        self._check_beam_search()
        if not self.scores_only:
            # Only the field that counts, whose range holds whether the schema states it (chat) or not (legacy).
            token_limit(self.max_tokens_param).check(self.max_new_tokens, self.max_tokens_param)
        need(
            self.max_new_tokens is None or self.min_tokens <= self.max_new_tokens,
            "min_tokens must be less than or equal to max_tokens",
            "min_tokens",
        )
        need(
            # An empty object asks for nothing, and vLLM lets it pass.
            self.stream_options is None or not self.stream_options.model_fields_set or self.stream,
            "Stream options can only be defined when `stream=True`.",
            "stream_options",
        )
        need(
            self.truncate_prompt_tokens is None
            or self.truncate_prompt_tokens >= -1
            and self.truncate_prompt_tokens != 0,
            "truncate_prompt_tokens must be -1 or at least 1",
            "truncate_prompt_tokens",
        )
        self._check_prompt_logprobs()
        check_cache_salt(self.cache_salt)
        self._check_structured()
        self._check_token_filters()

    def _check_token_filters(self) -> None:
        """vLLM's checks of the token filters and logprob ids that need no vocabulary (check_vocab has those)."""
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise BadRequest("allowed_token_ids is not None and empty!", "allowed_token_ids")
        if any(not word for word in self.bad_words):
            raise BadRequest("bad_words cannot contain an empty string.", "bad_words")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise BadRequest(f"bad_words may hold at most {MAX_BAD_WORDS} words.", "bad_words")
        if self.logprob_token_ids and self.num_logprobs is None:
            raise BadRequest(f"when using `logprob_token_ids`, {self.logprobs_needed}.", "logprob_token_ids")
        if len(self.logprob_token_ids or []) > MAX_LOGPROB_TOKEN_IDS:
            raise BadRequest(
                f"Requested logprob_token_ids of length {len(self.logprob_token_ids or [])}, which is greater than "
                f"max allowed: {MAX_LOGPROB_TOKEN_IDS}",
                "logprob_token_ids",
            )

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives per token to report, or None for no logprobs."""
        return None

    @property
    def logprobs_needed(self) -> str:
        """What logprob_token_ids needs of the request, in vLLM's words."""
        return "`logprobs` must be set"

    @property
    def scores_only(self) -> bool:
        """Whether the request only scores its prompt, generating nothing it shows."""
        return False

    def _check_prompt_logprobs(self) -> None:
        """vLLM's rules and words."""
        k = self.prompt_logprobs
        if k is None:
            return
        if self.stream and (k > 0 or k == -1):
            raise BadRequest("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if k < -1:
            raise BadRequest("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
        if k == -1 or k > MAX_TOP_LOGPROBS:
            asked = "the whole vocabulary" if k == -1 else k
            raise BadRequest(
                f"Requested prompt logprobs of {asked}, which is greater than max allowed: {MAX_TOP_LOGPROBS}",
                "prompt_logprobs",
            )

    @property
    def candidates(self) -> int:
        """How many sequences are sampled: best_of, else n."""
        return self.n if self.use_beam_search else self.best_of or self.n

    def _check_best_of(self) -> None:
        if self.best_of is None or self.use_beam_search:
            return
        if self.best_of < self.n:
            raise BadRequest(
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.", "best_of"
            )

    def _check_beam_search(self) -> None:
        """Beam search picks tokens by their log-probabilities alone: a field that would shape them otherwise is
        refused by name rather than ignored (temperature and seed change nothing, as in vLLM)."""
        if not self.use_beam_search:
            return
        if self.best_of not in (None, self.n):
            raise BadRequest("best_of is not supported with beam search: the beam width is n.", "best_of")
        fmt = self.response_format
        asks = {
            "stop": bool(self.stop),
            "top_p": self.top_p not in (None, 1.0),
            "top_k": self.top_k not in (None, 0, -1),
            "min_p": self.min_p not in (None, 0.0),
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "logit_bias": bool(self.logit_bias),
            "min_tokens": self.min_tokens != 0,
            "response_format": fmt is not None and fmt.type != "text",
            "structured_outputs": self.structured_outputs is not None,
            "logprobs": self.num_logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "repetition_detection": self.repetition_detection is not None,
            "thinking_token_budget": self.thinking_token_budget is not None,
        }
        for name, asked in asks.items():
            if asked:
                raise BadRequest(f"`{name}` is not supported with beam search.", name)

    @classmethod
    def _ranges(cls) -> Iterator[tuple[str, Range]]:
        """The fields with a range, but the token limits: only the one that counts is checked."""
        for name, f in cls.model_fields.items():
            if isinstance(f.json_schema_extra, Range) and name not in ("max_tokens", "max_completion_tokens"):
                yield name, f.json_schema_extra

    def _check_structured(self) -> None:
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise BadRequest(
                    "`response_format` of type json_schema needs a `json_schema` with a `schema`.", "response_format"
                )
            check_schema(fmt.json_schema.schema_, "response_format")
        if fmt is not None and fmt.type == "structural_tag":
            check_structural_tag(fmt.structural_tag(), "response_format")
        so = self.structured_outputs
        if so is not None:
            for name, value in (so.model_extra or {}).items():
                if value is not None and value is not False:
                    raise BadRequest(
                        f"`structured_outputs.{name}` is not supported by this server", f"structured_outputs.{name}"
                    )
            kinds = so.kinds()
            if len(kinds) != 1:
                raise BadRequest(
                    "`structured_outputs` takes exactly one of json, regex, choice, grammar or structural_tag.",
                    "structured_outputs",
                )
            if fmt is not None and fmt.type != "text":
                raise BadRequest(
                    "Give either `response_format` or `structured_outputs`, not both.", "structured_outputs"
                )
            if so.regex is not None:
                check_regex(so.regex)
            if so.choice is not None and (not so.choice or any(not c for c in so.choice)):
                raise BadRequest("structured_outputs.choice needs non-empty strings.", "structured_outputs")
            if so.choice is not None and (found := size_problem({"enum": so.choice})) is not None:
                raise BadRequest(
                    f"structured_outputs.choice is larger than the grammar engine takes: {found}.", "structured_outputs"
                )
            if so.grammar is not None and not so.grammar.strip():
                raise BadRequest("structured_outputs.grammar must not be empty.", "structured_outputs")
            if so.structural_tag is not None:
                check_structural_tag(json_text(so.structural_tag, "structural_tag"), "structured_outputs")
            if isinstance(so.json_, str):
                check_schema(json_text(so.json_, "json"), "structured_outputs")
            elif so.json_ is not None:
                check_schema(so.json_, "structured_outputs")

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id the request names must be one of the model's: logit_bias keys (the error lists each one
        that is not), allowed_token_ids and logprob_token_ids (worded as vLLM words them)."""
        self._check_bias(vocab_size)
        if any(not 0 <= t < vocab_size for t in self.allowed_token_ids or []):
            raise BadRequest("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
        bad = [t for t in self.logprob_token_ids or [] if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(
                f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
                "logprob_token_ids",
            )

    def _check_bias(self, vocab_size: int) -> None:
        """Every logit_bias key must be a token id of the model; the error lists each one that is not."""

        def ok(key: str) -> bool:
            try:
                return 0 <= int(key) < vocab_size
            except ValueError:
                return False

        bad = [key for key in self.logit_bias or {} if not ok(key)]
        if bad:
            raise BadRequest(
                f"logit_bias keys must be token ids in 0..{vocab_size - 1}; invalid: {', '.join(map(repr, bad))}",
                "logit_bias",
            )

    def bias(self) -> dict[int, float]:
        """logit_bias with integer keys and values clamped to [-100, 100], as OpenAI does."""
        return {int(k): max(-100.0, min(100.0, v)) for k, v in (self.logit_bias or {}).items()}
