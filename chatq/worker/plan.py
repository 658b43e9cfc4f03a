"""What a request asks of the generate and parse stages: sampling parameters, a grammar, a parser per choice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson

from chatq.core.errors import BadRequest
from chatq.core.requests import ChatCompletionRequest, CompletionRequest
from chatq.core.settings import Settings
from chatq.worker.grammar import Grammar, GrammarCompiler, GrammarError
from chatq.worker.parse import ContentParser, Parser
from chatq.worker.parse.forced import NamedToolParser, RequiredToolParser
from chatq.worker.parse.reasoning import ReasoningParser
from chatq.worker.parse.tools import TOOL_PARSERS, FirstCallOnly
from chatq.worker.sampler import SamplingParams


@dataclass
class Plan:
    params: list[SamplingParams]  # one per choice
    grammar: Grammar | None
    make_parser: Callable[[], Parser]
    reasoning: bool  # a reasoning parser splits the output
    tools_parsed: bool  # tool calls may come out of the text
    named_tool: bool  # a named tool_choice: finish_reason stays "stop"
    forced_tools: bool = False  # a named or "required" tool_choice: the output is the calls


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest, max_tokens: int, eos_ids: frozenset[int], defaults: dict[str, float]
) -> list[SamplingParams]:
    stop_ids = frozenset(req.stop_token_ids or []) | (frozenset() if req.ignore_eos else eos_ids)
    s = req.sampling(defaults)
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
            logprobs=req.num_logprobs,
        )
        for i in range(req.n)
    ]


def grammar_for(req: ChatCompletionRequest | CompletionRequest, compiler: GrammarCompiler) -> Grammar | None:
    param = "tools"  # what a grammar that cannot be compiled is reported against
    try:
        if isinstance(req, ChatCompletionRequest) and (req.forced_tool or req.tool_choice == "required"):
            tools = [t.model_dump() for t in req.tools or []]
            if req.forced_tool:
                return compiler.function(tools, req.forced_tool)
            return compiler.tool_calls(tools, parallel=req.parallel_tool_calls)
        param = "response_format"
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            return compiler.json_object()
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
            # Held to the schema with or without `strict: true`, as vLLM holds it: no property it does not list.
            return compiler.json_schema(fmt.json_schema.schema_ or {})
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
    except (GrammarError, orjson.JSONDecodeError) as e:
        raise BadRequest(str(e), param) from e
    return None


def plan(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    eos_ids: frozenset[int],
    defaults: dict[str, float],
    compiler: GrammarCompiler | None,
    settings: Settings,
) -> Plan:
    params = sampling_params(req, max_tokens, eos_ids, defaults)
    grammar = grammar_for(req, compiler) if compiler is not None else None
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
