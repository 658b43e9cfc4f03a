"""Grammar masks with the real tokenizer, then constrained decoding with the real SmolLM2 model."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.errors import BadRequest
from chatq.core.settings import Settings
from chatq.worker.grammar import Grammar, GrammarCompiler, GrammarError, GrammarState, apply_masks, tool_calls_schema
from chatq.worker.plan import grammar_for
from chatq.worker.sampler import Row, SamplingParams, sample
from tests.helpers import model_info

MODEL_DIR = Settings().model_dir
VOCAB = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 30},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20},
    },
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Web search", "parameters": SEARCH}},
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "status": {"enum": ["active", "inactive", "banned"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "status", "address", "tags"],
}
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    info = model_info()
    return GrammarCompiler(info.tokenizer, VOCAB, eos_token_ids=info.eos_token_ids)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def allowed(state: GrammarState) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    apply_masks(logits.view(1, -1), [state])
    return logits != float("-inf")


# --- masks and states, tokenizer only ------------------------------------------------------------------------

ADA = '{"name": "Ada", "age": 36, "status": "active", "address": {"city": "London", "zip": "12345"}, "tags": ["x"]}'

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]} | {
    "additionalProperties": False
}
# Free text, in which a call opens at its trigger and then holds to its schema up to its end: xgrammar's format.
CITY_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {"begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": CITY}}
            | {"end": "</function>"}
        ],
    },
}

# (grammar, a valid output, a prefix of it, a continuation of that prefix the grammar forbids)
CASES: dict[str, tuple[Any, str, str, str]] = {
    "nested_json": (lambda c: c.json_schema(PERSON), ADA, '{"name": "Ada", "age": ', '"36"'),
    "enum": (lambda c: c.json_schema(PERSON), ADA, '{"name": "Ada", "age": 36, "status": "', 'unknown"'),
    "pattern": (
        lambda c: c.json_schema(PERSON),
        ADA,
        '{"name": "Ada", "age": 36, "status": "active", "address": {"city": "London", "zip": "',
        'abc"',
    ),
    "json_object": (lambda c: c.json_object(), '{"a": [1, {"b": null}], "c": "d"}', "", "[1]"),
    "tool_calls": (
        lambda c: c.tool_calls(TOOLS),
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "search", "parameters": {"query": "croissants", "limit": 3}}]',
        '[{"name": "search", "parameters": {"',
        'city"',  # the weather tool's argument, not search's
    ),
    "named_function": (
        lambda c: c.function(TOOLS, "get_weather"),
        '{"city": "Paris", "unit": "fahrenheit"}',
        '{"city": "Paris", "unit": "',
        'kelvin"',
    ),
    "regex": (lambda c: c.regex(r"[A-Z][a-z]+ [0-9]{4}-[0-9]{2}-[0-9]{2}"), "Monday 2024-03-15", "Monday ", "x"),
    "choice": (lambda c: c.choice(["positive", "negative", 'it\'s "neutral"']), 'it\'s "neutral"', "", "maybe"),
    "lark": (lambda c: c.grammar(LARK), "(12+3)-(4-5)", "(12+", ")"),
    "ebnf": (lambda c: c.grammar('root ::= ("yes" | "no") "!"*'), "yes!!", "", "maybe"),
    "structural_tag": (
        lambda c: c.structural_tag(CITY_TAG),
        'Let me look. <function=get_weather>{"city": "Paris"}</function> Done.',
        'Sure: <function=get_weather>{"',
        'town"',
    ),
    "structural_tag_structures": (
        lambda c: c.structural_tag(
            {"structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}]}
            | {"triggers": ["<function="]}
        ),
        'Let me look. <function=get_weather>{"city": "Paris"}</function> Done.',
        'Sure: <function=get_weather>{"',
        'town"',
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_valid_output_is_accepted_and_terminates(case: str, compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    build, valid, prefix, bad = CASES[case]
    grammar = build(compiler)
    state = GrammarState(grammar)
    for t in ids(tokenizer, valid):
        assert allowed(state)[t], tokenizer.decode([t])
        assert state.accept(t)
    assert not state.is_terminated()
    eos = compiler.eos_token_ids[0]
    assert allowed(state)[eos]
    assert state.accept(eos)
    assert state.is_terminated()

    state = GrammarState(grammar)
    for t in ids(tokenizer, prefix):
        assert state.accept(t)
    first_bad = ids(tokenizer, bad)[0]
    mask = allowed(state)
    assert not mask[first_bad], tokenizer.decode([first_bad])
    assert not mask[compiler.eos_token_ids].any()
    assert mask.any()
    assert not state.accept(first_bad)


def test_complete_grammar_allows_only_eos(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    state = GrammarState(compiler.tool_calls(TOOLS, parallel=False))
    for t in ids(tokenizer, '[{"name": "search", "parameters": {"query": "x"}}]'):
        assert state.accept(t)
    assert allowed(state).nonzero().flatten().tolist() == compiler.eos_token_ids


def test_a_complete_grammar_ends_the_output_even_before_min_tokens(compiler: GrammarCompiler, tokenizer: Tokenizer):
    state = GrammarState(compiler.choice(["yes"]))
    output = ids(tokenizer, "yes")
    assert all(state.accept(t) for t in output)
    eos = compiler.eos_token_ids
    params = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, stop_token_ids=frozenset(eos))
    [token], _ = sample(torch.randn(1, VOCAB), [Row(params, None, [], output, state)])
    assert token in eos and state.accept(token)
    # Without a grammar, min_tokens still holds the stop tokens off.
    logits = torch.zeros(1, VOCAB)
    logits[0, eos] = 10.0
    [token], _ = sample(logits, [Row(params, None, [], output)])
    assert token not in eos


def test_strict_closes_objects(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prefix, extra = '{"a": 1', ', "b": 2}'
    for strict, ok in ((True, False), (False, True)):
        state = GrammarState(compiler.json_schema(schema, strict=strict))
        assert all(state.accept(t) for t in ids(tokenizer, prefix))
        assert all(state.accept(t) for t in ids(tokenizer, extra)) is ok


@pytest.mark.parametrize("strict", [None, False, True])
def test_a_response_format_schema_allows_no_property_it_does_not_list(
    compiler: GrammarCompiler, tokenizer: Tokenizer, strict: bool | None
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
    grammar = grammar_for(
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], response_format=fmt), compiler
    )
    assert grammar is not None
    state = GrammarState(grammar)
    assert all(state.accept(t) for t in ids(tokenizer, '{"a": 1'))
    assert not all(state.accept(t) for t in ids(tokenizer, ', "b": 2}'))


@pytest.mark.parametrize(
    ("schema", "good", "short"),
    [
        ({"type": "array", "minItems": 1}, "[1, 2]", "[]"),
        ({"type": "object", "minProperties": 1}, '{"a": 1}', "{}"),
    ],
)
def test_strict_mode_takes_a_least_size_on_items_or_properties_it_does_not_list(
    compiler: GrammarCompiler, tokenizer: Tokenizer, schema: dict, good: str, short: str
) -> None:
    # Ordinary tool parameters ("at least one tag"), which xgrammar's strict mode alone refused to compile.
    state = GrammarState(compiler.json_schema(schema, strict=True))
    assert all(state.accept(t) for t in ids(tokenizer, good))
    empty = GrammarState(compiler.json_schema(schema, strict=True))
    assert not all(empty.accept(t) for t in ids(tokenizer, short))


def test_special_tokens_are_not_text(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    state = GrammarState(compiler.json_object())
    for t in ids(tokenizer, '{"a": "'):
        assert state.accept(t)
    mask = allowed(state)
    assert mask[ids(tokenizer, "hello")[0]]
    assert not mask[[tokenizer.token_to_id(s) for s in ("<|im_start|>", "<|endoftext|>", "<repo_name>")]].any()


def test_apply_masks_only_touches_rows_with_a_grammar(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    a, b = GrammarState(compiler.choice(["yes", "no"])), GrammarState(compiler.regex("[0-9]+"))
    logits = torch.randn(4, VOCAB)
    expected = logits.clone()
    for row, state in ((0, a), (2, b)):
        apply_masks(expected[row : row + 1], [state])
    apply_masks(logits, [a, None, b, None])
    assert torch.equal(logits, expected)
    firsts = [tokenizer.decode([t]) for t in (logits[0] != float("-inf")).nonzero().flatten().tolist()]
    assert {"yes", "no"} <= set(firsts) and all("yes".startswith(f) or "no".startswith(f) for f in firsts)
    apply_masks(logits, [None] * 4)
    assert torch.equal(logits, expected)


def test_logprobs_under_a_grammar_are_over_what_it_allows(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    # As vLLM reports them: the grammar masks before logprobs are taken; a forbidden token reads -9999, not -inf.
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=20)
    [token], [lp] = sample(logits, [Row(params, None, [], [], GrammarState(compiler.choice(["yes", "no"])))])
    assert lp is not None and lp.logprob == lp.top[0][1] and lp.top[0][0] == token
    allowed = [(t, v) for t, v in lp.top if v > -9999]
    assert sum(math.exp(v) for _, v in allowed) == pytest.approx(1.0, abs=1e-4)
    assert all("yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t])) for t, _ in allowed)
    assert all(v == -9999 for _, v in lp.top[len(allowed) :])


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda c: c.json_schema({"type": "strnig"}), "strnig"),
        (lambda c: c.json_schema({"properties": {"a": {"$ref": "#/$defs/missing"}}}), "defs"),
        (lambda c: c.json_schema(["not", "a", "schema"]), "object"),
        (lambda c: c.regex("(ab"), "parenthesis"),
        (lambda c: c.grammar("start: foo"), "foo"),
        (lambda c: c.grammar('root ::= "a" | '), "EBNF"),
        (lambda c: c.choice([]), "non-empty"),
        (lambda c: c.tool_calls([]), "at least one tool"),
        (lambda c: c.function(TOOLS, "get_time"), "get_time"),
        (lambda c: c.structural_tag({"type": "structural_tag", "format": {"type": "nope"}}), "nope"),
    ],
)
def test_invalid_grammars_raise_value_errors(compiler: GrammarCompiler, build: Any, needle: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(needle)) as err:
        build(compiler)
    assert isinstance(err.value, ValueError)
    assert ".cc:" not in str(err.value)


def test_compile_is_cached(compiler: GrammarCompiler) -> None:
    compiler._compiler.clear_cache()
    first = compiler.tool_calls(TOOLS)
    cached = compiler._compiler.get_cache_size_bytes()
    assert cached > 0
    assert compiler.tool_calls(TOOLS).serialize_json() == first.serialize_json()
    assert compiler._compiler.get_cache_size_bytes() == cached  # the second was the first, not compiled again


# --- constrained decoding with the real model -----------------------------------------------------------------

NEW = 64


@pytest.fixture(scope="module")
def model() -> Iterator[torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    # Two cores shared with other processes: one thread avoids OpenMP spin contention (~20x slower steps here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    torch.set_num_threads(threads)


def chat(tokenizer: Tokenizer, question: str) -> list[int]:
    text = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )
    return ids(tokenizer, text)


def generate(model: torch.nn.Module, tokenizer: Tokenizer, question: str, grammar: Grammar) -> list[str]:
    """One batch of three copies of the prompt, each row with its own state: row 0 greedy, rows 1-2 sampled at
    temperature 1 with their own seeded generator. Every row must end (EOS accepted) within NEW tokens."""
    from transformers import DynamicCache

    states = [GrammarState(grammar) for _ in range(3)]
    generators = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    out: list[list[int]] = [[] for _ in states]
    cache = DynamicCache(config=model.config)
    inputs = torch.tensor([chat(tokenizer, question)] * len(states))
    with torch.inference_mode():
        for _ in range(NEW):
            logits = model(inputs, cache=cache, use_cache=True).logits[:, -1].float()
            live = [None if s.is_terminated() else s for s in states]
            apply_masks(logits, live)
            tokens = [
                int(row.argmax()) if g is None else int(torch.multinomial(row.softmax(-1), 1, generator=g))
                for row, g in zip(logits, generators, strict=True)
            ]
            for state, t, ids_ in zip(live, tokens, out, strict=True):
                if state is not None:
                    assert state.accept(t), f"masked token {t} was picked"
                    if not state.is_terminated():  # the EOS that ends it is not text
                        ids_.append(t)
            if all(s.is_terminated() for s in states):
                break
            inputs = torch.tensor(tokens)[:, None]
    texts = [tokenizer.decode(o) for o in out]
    assert all(s.is_terminated() for s in states), f"not finished within {NEW} tokens: {texts}"
    return texts


# Small enough to finish within NEW tokens even when sampled: bounded strings and arrays.
SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 10},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "status": {"enum": ["active", "inactive", "banned"]},
                "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2},
            },
            "required": ["name", "age", "status", "address", "tags"],
        },
        "Describe a fictional person living in Paris as JSON.",
    ),
    "inventory": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                            "kind": {"enum": ["fruit", "tool", "book"]},
                        },
                        "required": ["sku", "kind"],
                        "additionalProperties": False,
                    },
                },
                "open": {"type": "boolean"},
            },
            "required": ["items", "open"],
            "additionalProperties": False,
        },
        "List two items of a small shop's inventory as JSON.",
    ),
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_model_follows_json_schema(
    name: str, model: torch.nn.Module, tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    schema, question = SCHEMAS[name]
    for text in generate(model, tokenizer, question, compiler.json_schema(schema)):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("parallel", [True, False])
def test_model_calls_tools_when_required(
    parallel: bool, model: torch.nn.Module, tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    grammar = compiler.tool_calls(TOOLS, parallel=parallel)
    results = generate(model, tokenizer, "Find the weather in Berlin in celsius.", grammar)
    for text in results:
        calls = json.loads(text)
        jsonschema.validate(calls, tool_calls_schema(TOOLS, parallel=parallel))
        assert parallel or len(calls) == 1
    # Greedy calls the tool twice when it may: the array really is open-ended then.
    assert len(json.loads(results[0])) == (2 if parallel else 1)


def test_model_fills_named_function(model: torch.nn.Module, tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    for text in generate(model, tokenizer, "Weather in Tokyo?", compiler.function(TOOLS, "get_weather")):
        jsonschema.validate(json.loads(text), WEATHER)


def test_model_follows_regex_and_choice(
    model: torch.nn.Module, tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    for text in generate(model, tokenizer, "When did WW2 end? Answer with a date.", compiler.regex(date)):
        assert re.fullmatch(date, text)
    choices = ["positive", "negative", "neutral"]
    review = "Classify the sentiment of: 'The food was wonderful and the staff were kind.'"
    assert set(generate(model, tokenizer, review, compiler.choice(choices))) <= set(choices)


@pytest.mark.parametrize(
    "pattern",
    [r"\d{3}-\d{4}", r"(?:ab)+c*?", r"^(yes|no)$", r"(?<=a)b", r"x(?!y)", r"(a)\1", r"(a)?(?(1)b|c)", r"\bword"]
    + [r"(?P<year>\d+)", r"(?i)yes", r"(?i:yes)", r"a++", r"(?>a)", r"[^\W\d]+", r"a{,3}", r"a{0,3}", r"(?#c)ab"]
    + [r"(?u)a", r"\N{DIGIT ONE}", r"[{,]x", r"[]a]+", r"\101"],
)
def test_the_api_refuses_exactly_the_regexes_the_grammar_engine_cannot_compile(pattern):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": pattern}}
    )
    try:
        req.check()
        refused = False
    except BadRequest:
        refused = True
    try:
        xgr.Grammar.from_regex(pattern)
        compiles = True
    except RuntimeError:
        compiles = False
    assert refused != compiles


def test_octal_escapes_are_refused_because_the_grammar_engine_reads_them_otherwise():
    from xgrammar.testing import _is_grammar_accept_string as accepts

    for pattern in (r"\012", r"[\012]"):  # a newline to Python
        assert not accepts(xgr.Grammar.from_regex(pattern), "\n")
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": pattern}}
        )
        with pytest.raises(BadRequest, match="octal escapes"):
            req.check()


def test_string_anchors_are_refused_because_the_grammar_engine_reads_them_as_letters():
    from xgrammar.testing import _is_grammar_accept_string as accepts

    grammar = xgr.Grammar.from_regex(r"\A\d+\Z")  # compiles, but not to what Python means by it
    assert accepts(grammar, "A12Z") and not accepts(grammar, "12")
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": r"\A\d+\Z"}}
    )
    with pytest.raises(BadRequest, match="string anchors"):
        req.check()


def strict_request(**fields: Any) -> ChatCompletionRequest:
    tools = [TOOLS[0] | {"function": TOOLS[0]["function"] | {"strict": True}}, TOOLS[1]]
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, **fields)


def takes(grammar: Grammar, tokenizer: Tokenizer, text: str) -> bool:
    state = GrammarState(grammar)
    return all(state.accept(t) for t in ids(tokenizer, text))


@pytest.mark.parametrize(
    ("parser", "call"),
    [
        ("hermes", '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'),
        ("hermes", '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'),
        ("llama3_json", '{{"name": "{name}", "parameters": {args}}}'),
    ],
)
def test_strict_tools_under_auto_hold_a_call_to_its_schema_once_it_opens(compiler, tokenizer, parser, call):
    grammar = grammar_for(strict_request(), compiler, parser)
    assert grammar is not None

    def written(name: str, args: str, before: str = "Let me look. ") -> str:
        return before + call.format(name=name, args=args)

    good = '{"city": "Paris", "unit": "celsius"}'
    assert takes(grammar, tokenizer, written("get_weather", good) + " Done.")
    assert takes(grammar, tokenizer, "Just text, no call.")
    assert not takes(grammar, tokenizer, written("get_weather", '{"city": "Paris"}'))  # "unit" is required
    assert not takes(grammar, tokenizer, written("get_weather", '{"town": "Paris", "unit": "celsius"}'))
    assert not takes(grammar, tokenizer, written("get_time", "{}"))  # no such tool
    # A tool without `strict` keeps the call's shape, its arguments any JSON object.
    assert takes(grammar, tokenizer, written("search", '{"anything": [1, 2]}'))
    assert not takes(grammar, tokenizer, written("search", '"text"'))
    one = grammar_for(strict_request(parallel_tool_calls=False), compiler, parser)
    assert one is not None
    assert takes(one, tokenizer, written("get_weather", good))
    assert not takes(one, tokenizer, written("get_weather", good) + written("search", "{}", before=" "))


@pytest.mark.parametrize(
    ("parser", "fields"),
    [
        ("pythonic", {}),
        ("", {}),
        ("hermes", {"response_format": {"type": "json_object"}}),
        ("hermes", {"structured_outputs": {"regex": "a+"}}),
    ],
)
def test_strict_tools_under_auto_are_refused_by_name_where_they_cannot_be_held(compiler, parser, fields):
    with pytest.raises(BadRequest) as e:
        grammar_for(strict_request(**fields), compiler, parser)
    assert e.value.param == "tools.0.function.strict"
    grammar_for(strict_request(tool_choice="none", **fields), compiler, parser)  # no call to hold: no refusal
