"""What a request asks of the generate and parse stages: sampling parameters, a grammar, a parser per choice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson
from tokenizers import Tokenizer

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.errors import BadRequest
from chatq.core.settings import Settings
from chatq.worker.grammar import CALL_TAGS, Grammar, GrammarCompiler, GrammarError
from chatq.worker.parse import ContentParser, Parser
from chatq.worker.parse.forced import NamedToolParser, RequiredToolParser
from chatq.worker.parse.reasoning import THINK_END, THINK_START, ReasoningParser
from chatq.worker.parse.tools import TOOL_PARSERS, FirstCallOnly
from chatq.worker.sampler import SamplingParams, ThinkingBudget


@dataclass
class Plan:
    params: list[SamplingParams]  # one per choice
    grammar: Grammar | None
    make_parser: Callable[[], Parser]
    reasoning: bool  # a reasoning parser splits the output
    tools_parsed: bool  # tool calls may come out of the text
    named_tool: bool  # a named tool_choice: finish_reason stays "stop"
    forced_tools: bool = False  # a named or "required" tool_choice: the output is the calls


def thinking_budget(
    req: ChatCompletionRequest | CompletionRequest, settings: Settings, tokenizer: Tokenizer
) -> ThinkingBudget | None:
    """The request's thinking_token_budget, with the reasoning parser's markers as token ids (as vLLM tokenizes its
    reasoning parser's start and end strings); a 400 for a model without a reasoning parser, as vLLM refuses it."""
    if req.thinking_token_budget is None:
        return None
    if not settings.reasoning_parser:
        raise BadRequest(
            "thinking_token_budget is set but this model has no reasoning parser: its workers need "
            "CHATQ_REASONING_PARSER to use thinking_token_budget.",
            "thinking_token_budget",
        )
    start, end = (tuple(tokenizer.encode(tag, add_special_tokens=False).ids) for tag in (THINK_START, THINK_END))
    return ThinkingBudget(req.thinking_token_budget, start, end)


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    eos_ids: frozenset[int],
    defaults: dict[str, float],
    bad_words: list[list[int]] | None = None,
    thinking: ThinkingBudget | None = None,
) -> list[SamplingParams]:
    """One choice's parameters per choice; `bad_words`: the request's, tokenized (chatq.core.render.bad_words_ids)."""
    stop_ids = frozenset(req.stop_token_ids or []) | (frozenset() if req.ignore_eos else eos_ids)
    rd = req.repetition_detection
    repetition = (rd.min_pattern_size, rd.max_pattern_size, rd.min_count) if rd and rd.max_pattern_size else None
    s = req.sampling(defaults)
    # Choosing the best of more candidates than answers takes each sampled token's logprob, asked for or not.
    logprobs = (req.num_logprobs or 0) if req.candidates > req.n else req.num_logprobs
    return [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=s["temperature"],
            top_p=s["top_p"],
            top_k=int(s["top_k"]),
            min_p=s["min_p"],
            # Choices of one request must differ, yet stay reproducible under one seed.
            seed=None if req.seed is None else req.seed + i,
            presence_penalty=s["presence_penalty"],
            frequency_penalty=s["frequency_penalty"],
            repetition_penalty=s["repetition_penalty"],
            logit_bias=req.bias(),
            min_tokens=req.min_tokens,
            stop_token_ids=stop_ids,
            logprobs=logprobs,
            prompt_logprobs=req.num_prompt_logprobs,
            logprob_ids=tuple(req.logprob_token_ids or ()),
            allowed_ids=tuple(dict.fromkeys(req.allowed_token_ids or ())),
            bad_words=tuple(tuple(w) for w in bad_words or ()),
            repetition=repetition,
            thinking=thinking,
        )
        for i in range(req.candidates)
    ]


def grammar_for(
    req: ChatCompletionRequest | CompletionRequest, compiler: GrammarCompiler, tool_parser: str = ""
) -> Grammar | None:
    """The grammar the request holds its output to; `tool_parser`: how the model writes its own calls."""
    param = "tools"  # what a grammar that cannot be compiled is reported against
    try:
        if isinstance(req, ChatCompletionRequest) and (req.forced_tool or req.tool_choice == "required"):
            tools = [t.model_dump() for t in req.tools or []]
            if req.forced_tool:
                return compiler.function(tools, req.forced_tool)
            return compiler.tool_calls(tools, parallel=req.parallel_tool_calls)
        strict = first_strict_tool(req)
        if isinstance(req, ChatCompletionRequest) and strict is not None:
            param = f"tools.{strict}.function.strict"
            return strict_tools(req, compiler, tool_parser, param)
        param = "response_format"
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            return compiler.json_object()
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
            # Held to the schema with or without `strict: true`, as vLLM holds it: no property it does not list.
            return compiler.json_schema(fmt.json_schema.schema_ or {})
        if fmt is not None and fmt.type == "structural_tag":
            return compiler.structural_tag(fmt.structural_tag())
        so = req.structured_outputs
        param = "structured_outputs"
        if so is None:
            return None
        if so.json_ is not None:
            schema = orjson.loads(so.json_) if isinstance(so.json_, str) else so.json_  # as the API read it
            return compiler.json_schema(schema)
        if so.regex is not None:
            return compiler.regex(so.regex)
        if so.choice is not None:
            return compiler.choice(so.choice)
        if so.grammar is not None:
            return compiler.grammar(so.grammar)
        if so.structural_tag is not None:
            return compiler.structural_tag(orjson.loads(so.structural_tag))  # an object, as the API read it
    except (GrammarError, orjson.JSONDecodeError) as e:
        raise BadRequest(str(e), param) from e
    return None


def first_strict_tool(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The index of the first tool with `strict: true` under tool_choice "auto", where the model calls by itself."""
    if not isinstance(req, ChatCompletionRequest) or req.tool_choice not in (None, "auto"):
        return None
    return next((i for i, t in enumerate(req.tools or []) if t.function.strict), None)


def strict_tools(req: ChatCompletionRequest, compiler: GrammarCompiler, tool_parser: str, param: str) -> Grammar:
    """Calls held to their tools once they open, in the tool parser's format: strict tools' arguments to their
    schemas. Only formats a structural tag describes can be held so; refused by name otherwise."""
    if tool_parser not in CALL_TAGS:
        parsers = " and ".join(sorted(CALL_TAGS))
        raise BadRequest(
            f"`strict` tools under tool_choice auto are held to their schemas with the {parsers} tool parsers; "
            f"this model's is {tool_parser or 'none'}. Leave `strict` out, or name the tool or require one in "
            "`tool_choice`.",
            param,
        )
    fmt = req.response_format
    if req.structured_outputs is not None or (fmt is not None and fmt.type != "text"):
        raise BadRequest(
            "`strict` tools under tool_choice auto cannot be combined with `response_format` or `structured_outputs`.",
            param,
        )
    tools = [t.model_dump() for t in req.tools or []]
    return compiler.tool_tags(tool_parser, tools, parallel=req.parallel_tool_calls)


def plan(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    eos_ids: frozenset[int],
    defaults: dict[str, float],
    compiler: GrammarCompiler | None,
    settings: Settings,
    tokenizer: Tokenizer,
    bad_words: list[list[int]] | None = None,
) -> Plan:
    params = sampling_params(req, max_tokens, eos_ids, defaults, bad_words, thinking_budget(req, settings, tokenizer))
    grammar = grammar_for(req, compiler, settings.tool_parser) if compiler is not None else None
    if isinstance(req, CompletionRequest):
        return Plan(params, grammar, ContentParser, False, False, False)
    tool_names = {t.function.name for t in req.tools or []}
    inner: Callable[[], Parser] = ContentParser
    tools_parsed = False
    if req.forced_tool:
        name = req.forced_tool
        inner, tools_parsed = (lambda: NamedToolParser(name)), True
    elif req.tool_choice == "required":
        inner, tools_parsed = RequiredToolParser, True
    elif req.tools and req.tool_choice != "none" and settings.tool_parser:
        factory = TOOL_PARSERS[settings.tool_parser]
        one_call = not req.parallel_tool_calls
        inner = lambda: FirstCallOnly(factory(tool_names)) if one_call else factory(tool_names)  # noqa: E731
        tools_parsed = True
    reasoning = bool(settings.reasoning_parser)
    make_parser = inner
    if reasoning:
        # A grammar then shapes only what follows the thought (applied once it ends), as in vLLM. DeepSeek-R1
        # templates take no `enable_thinking`: the model always thinks, as vLLM's parser assumes.
        thinking = req.thinking or settings.reasoning_parser == "deepseek_r1"
        make_parser = lambda: ReasoningParser(inner(), thinking_enabled=thinking)  # noqa: E731
    named = req.forced_tool is not None
    return Plan(params, grammar, make_parser, reasoning, tools_parsed, named, named or req.tool_choice == "required")
