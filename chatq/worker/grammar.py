"""Constrained decoding: a grammar per request, applied as a per-sequence logits mask inside the batched step.

Built on xgrammar rather than llguidance: it does its work at compile time, outside the step, its masks agree with
its matcher, and it masks logits rows in place (docs/performance.md).

Usage: one `GrammarCompiler` per worker; a `Grammar` per request from one of its methods; a `GrammarState` per
sequence; each step `apply_masks(logits, states)` before sampling (a logit bias added later leaves masked tokens at
-inf), then `state.accept(token)`. A complete grammar allows only EOS, which sets `is_terminated()` (the engine
finishes with "stop"); `accept` returning False is a bug.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import xgrammar as xgr
from tokenizers import Tokenizer

Grammar = xgr.CompiledGrammar

# A function declared without `parameters` takes none, as OpenAI reads it.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class GrammarError(ValueError):
    """The schema, regex, grammar or tool choice cannot be compiled; the message is fit for a 400."""


def _opened(node: Any) -> Any:
    """The schema with arrays and objects that ask for a least size, and list no items or properties, opened to any
    items or properties. In strict mode xgrammar closes them, and then refuses to compile `{"type": "array",
    "minItems": 1}` (no items may be added) though it writes `[1]` for `{"type": "array"}`."""
    if isinstance(node, list):
        return [_opened(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _opened(v) for k, v in node.items()}
    declared = out.get("type")
    types: list[Any] = declared if isinstance(declared, list) else [declared]
    if "array" in types and out.get("minItems") and "items" not in out and "prefixItems" not in out:
        out["items"] = True
    bare = not any(k in out for k in ("properties", "patternProperties", "additionalProperties"))
    if "object" in types and out.get("minProperties") and bare:
        out["additionalProperties"] = True
    return out


class GrammarCompiler:
    """Compiles request grammars against one model's tokenizer. Compiling is slow (xgrammar precomputes masks), so do
    it when a request arrives, not inside the engine step; results are cached by source text, and the compiler may
    be shared between threads."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        eos_token_ids: Sequence[int],
        cache_bytes: int = 256 << 20,
        threads: int = 2,
    ):
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
        # xgrammar treats an empty token as special (never allowed). Without this, control tokens such as
        # <|im_start|> would be allowed inside JSON strings as if they were their literal text.
        vocab = ["" if i in special else by_id.get(i, "") for i in range(vocab_size)]
        self.eos_token_ids = list(eos_token_ids)
        # What TokenizerInfo.from_huggingface does (with its private helper), minus transformers: it tells a
        # byte-level vocab from a byte-fallback or raw one.
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
        info = xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=self.eos_token_ids, **meta)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_limit_bytes=cache_bytes)

    def json_schema(self, schema: Mapping[str, Any], *, strict: bool = True) -> Grammar:
        """response_format json_schema. Both modes honour the schema; strict (OpenAI's strict: true) also closes
        objects that do not say otherwise, so the model cannot add properties the schema did not list."""
        if not isinstance(schema, Mapping):
            raise GrammarError("The JSON schema must be an object")

        def build() -> Grammar:
            # Not sort_keys: property order is the order the model writes them in. Fixed compact layout (", " and
            # ": "): with free whitespace, small models drift through newlines without finishing.
            text = json.dumps(_opened(schema) if strict else schema)
            return self._compiler.compile_json_schema(text, strict_mode=strict, any_whitespace=False)

        return _compile("JSON schema", build)

    def json_object(self) -> Grammar:
        """response_format json_object: any JSON object."""
        return self.json_schema({"type": "object"}, strict=False)

    def regex(self, pattern: str) -> Grammar:
        return _compile("regex", lambda: self._compiler.compile_regex(pattern))

    def choice(self, choices: Sequence[str]) -> Grammar:
        """Exactly one of the strings."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return _compile("choice", lambda: self._compiler.compile_grammar(ebnf))

    def grammar(self, source: str) -> Grammar:
        """A context-free grammar: xgrammar EBNF (GBNF-style, `root ::= ...`) when the text has `::=`, else Lark
        (`start: ...`, the subset xgrammar accepts)."""
        if "::=" in source:
            return _compile("EBNF grammar", lambda: self._compiler.compile_grammar(source))
        return _compile("Lark grammar", lambda: self._compiler.compile_lark(source))

    def structural_tag(self, tag: Mapping[str, Any]) -> Grammar:
        """A structural tag (xgrammar's): text held to its `format`, or free text in which each of the older
        `structures` opens at one of its `triggers`, as vLLM compiles either."""
        if "structures" not in tag:
            return _compile("structural tag", lambda: self._compiler.compile_structural_tag(json.dumps(tag)))
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}), end=s["end"])
            for s in tag["structures"]
        ]
        return _compile("structural tag", lambda: self._compiler.compile_structural_tag(items, tag["triggers"]))

    def tool_calls(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool = True) -> Grammar:
        """tool_choice "required": see `tool_calls_schema`."""
        return self.json_schema(tool_calls_schema(tools, parallel=parallel))

    def function(self, tools: Sequence[Mapping[str, Any]], name: str) -> Grammar:
        """A named tool_choice: the arguments object of that function."""
        functions = _functions(tools)
        if name not in functions:
            raise GrammarError(f"tool_choice names function {name!r}, which is not in tools")
        return self.json_schema(functions[name])

    def tool_tags(self, parser: str, tools: Sequence[Mapping[str, Any]], *, parallel: bool = True) -> Grammar:
        """tool_choice "auto" with a strict tool: see `tool_tags`."""
        return _compile("tool calls", lambda: self._compiler.compile_structural_tag(tool_tags(parser, tools, parallel)))


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar):
        self._matcher = xgr.GrammarMatcher(grammar)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """EOS was accepted after a complete output; the state must not be masked again."""
        return self._matcher.is_terminated()


def apply_masks(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Masks, in place, each row of logits [B, V] whose sequence has a grammar; rows with None are left alone."""
    rows = {i: s for i, s in enumerate(states) if s is not None}
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(states), logits.shape[-1])
    # A plain loop, not xgrammar's BatchGrammarMatcher: fills are cheap enough that its thread pool does not pay
    # (docs/performance.md, "Grammar masks").
    for i, state in rows.items():
        state._matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=list(rows))


def warm_up_masks(vocab: int, device: torch.device) -> None:
    """Compiles xgrammar's CUDA masking kernel (Triton) for the row counts it specializes on (1, a multiple of 16,
    any other) now, not in the first constrained steps, each of which would stall every stream while it compiles."""
    for n in (1, 2, 16):
        logits = torch.zeros(n, vocab, device=device)
        bitmask = xgr.allocate_token_bitmask(n, vocab)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(device), indices=list(range(n)))


def tool_calls_schema(tools: Sequence[Mapping[str, Any]], *, parallel: bool = True) -> dict[str, Any]:
    """A JSON array of {"name", "parameters"} calls, at least one, one at most when parallel_tool_calls is false.
    anyOf per tool pairs each name with its own parameters schema (an enum of names could not)."""
    functions = _functions(tools)
    if not functions:
        raise GrammarError('tool_choice "required" needs at least one tool')
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in functions.items()
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# Where a tool parser's calls open (the trigger), how a call opens up to its arguments and how it closes, as vLLM's
# structural tags write them: hermes with or without newlines inside its tags.
CALL_TAGS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "hermes": (
        ("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
        ("<tool_call>", '<tool_call>{{"name": {name}, "arguments": ', "}</tool_call>"),
    ),
    "llama3_json": (('{"name": ', '{{"name": {name}, "parameters": ', "}"),),
}


def tool_tags(parser: str, tools: Sequence[Mapping[str, Any]], parallel: bool) -> xgr.StructuralTag:
    """Text that runs free until a call opens in the parser's format; from there the call is held to one of the tools,
    a strict tool's arguments to its schema and any other's to a JSON object, as vLLM holds them. One call at most
    when parallel_tool_calls is false."""
    from xgrammar.structural_tag import JSONSchemaFormat, TagFormat, TriggeredTagsFormat

    strict = {fn["name"] for fn in _function_list(tools) if fn.get("strict") is True}
    tags = [
        TagFormat(
            begin=begin.format(name=json.dumps(name, ensure_ascii=False)),
            content=JSONSchemaFormat(json_schema=_opened(params) if name in strict else {"type": "object"}),
            end=end,
        )
        for name, params in _functions(tools).items()
        for _, begin, end in CALL_TAGS[parser]
    ]
    triggers = sorted({trigger for trigger, _, _ in CALL_TAGS[parser]})
    return xgr.StructuralTag(format=TriggeredTagsFormat(triggers=triggers, tags=tags, stop_after_first=not parallel))


def _function_list(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [tool.get("function", tool) for tool in tools if isinstance(tool, Mapping)]


def _functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """name -> parameters schema, from OpenAI tools ({"type": "function", "function": {...}}) or bare functions."""
    out = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise GrammarError("Every tool needs a function with a name")
        out[fn["name"]] = fn.get("parameters") or _NO_PARAMETERS
    return out


# xgrammar's C++ errors start with "[time] /path/file.cc:line: " and sometimes a failed check's text.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _compile(kind: str, build: Callable[[], Grammar]) -> Grammar:
    try:
        return build()
    except (RuntimeError, ValueError, TypeError) as e:
        message = _NOISE.sub("", str(e).strip()).strip()
        raise GrammarError(f"Invalid {kind}: {message}") from e
