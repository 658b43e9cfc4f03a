"""Tool calls and structured outputs with SmolLM2: constrained decoding keeps them valid every time."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.helpers import assert_error, snapshot, stream

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "enum": {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
        "required": ["colour", "sure"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
    },
    "numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "score": {"type": "number"}},
        "required": ["age", "score"],
    },
}
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}]


def parallel(fn, jobs):
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda args: fn(*args), jobs))


def test_named_tool_choice_returns_that_function_with_valid_arguments(client: openai.OpenAI, model_name):
    def call(sampling):
        return client.chat.completions.create(
            model=model_name,
            messages=ASK,
            tools=[WEATHER, TIME],
            max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            **sampling,
        )

    for resp in parallel(call, [(s,) for s in SAMPLINGS]):
        choice = resp.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == ""
        [tc] = choice.message.tool_calls
        assert tc.type == "function" and tc.function.name == "get_weather" and tc.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(tc.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("parallel_calls", [True, False])
def test_required_tool_choice_returns_valid_calls(client: openai.OpenAI, model_name, parallel_calls):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

    def call(sampling):
        return client.chat.completions.create(
            model=model_name,
            messages=ASK,
            tools=[WEATHER, TIME],
            max_tokens=120,
            tool_choice="required",
            parallel_tool_calls=parallel_calls,
            **sampling,
        )

    for resp in parallel(call, [(s,) for s in SAMPLINGS]):
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # vLLM: empty, not null
        calls = choice.message.tool_calls
        assert len(calls) >= 1 and (parallel_calls or len(calls) == 1)
        for tc in calls:
            jsonschema.validate(json.loads(tc.function.arguments), schemas[tc.function.name])


def test_streamed_tool_call_arguments_concatenate_to_the_whole(client: openai.OpenAI, model_name):
    kw = dict(
        model=model_name,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=80,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas = [
        tc
        for chunk in client.chat.completions.create(stream=True, **kw)
        if chunk.choices
        for tc in chunk.choices[0].delta.tool_calls or []
    ]
    named = [d for d in deltas if d.id is not None]
    assert len(named) == 1 and named[0].function.name == "get_weather" and named[0].type == "function"
    assert all(d.function.name is None for d in deltas if d.id is None)
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments


def test_json_schema_output_validates_every_time(client: openai.OpenAI, model_name):
    prompt = [{"role": "user", "content": "Describe a person as JSON."}]

    def call(name, sampling):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        return name, client.chat.completions.create(
            model=model_name, messages=prompt, response_format=fmt, max_tokens=120, **sampling
        )

    for name, resp in parallel(call, [(n, s) for n in SCHEMAS for s in SAMPLINGS]):
        assert resp.choices[0].finish_reason == "stop", (name, resp.choices[0].message.content)
        jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMAS[name])


def test_json_object_regex_choice_and_grammar(client: openai.OpenAI, model_name):
    prompt = [{"role": "user", "content": "Give me an answer."}]
    cases = [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {"extra_body": {"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} \d{2}"}}},
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} \d{2}", t),
        ),
        (
            {"extra_body": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}},
            lambda t: t in ("yes", "no", "maybe"),
        ),
        (
            {"extra_body": {"structured_outputs": {"grammar": 'root ::= "ab" [0-9] [0-9]'}}},
            lambda t: re.fullmatch(r"ab\d\d", t),
        ),
        (
            {
                "extra_body": {
                    "structured_outputs": {
                        "json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
                    }
                }
            },
            lambda t: json.loads(t)["ok"] in (True, False),
        ),
    ]

    def call(extra, sampling):
        return client.chat.completions.create(model=model_name, messages=prompt, max_tokens=60, **extra, **sampling)

    results = parallel(call, [(c[0], s) for c in cases for s in SAMPLINGS])
    for i, resp in enumerate(results):
        text = resp.choices[0].message.content
        assert cases[i // len(SAMPLINGS)][1](text), (cases[i // len(SAMPLINGS)][0], text)


WIDE = {f"p{i}": {"type": "string"} for i in range(501)}
HUGE_ENUM = {"type": "object", "properties": {"x": {"enum": [f"value {i}" for i in range(1001)]}}}
OK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def test_legacy_completions_hold_the_same_constraints(client: openai.OpenAI, model_name, http):
    cases = [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": r"\d{3}"}}, lambda t: re.fullmatch(r"\d{3}", t)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": OK}}}, json.loads),
    ]

    def call(extra, sampling):
        return client.completions.create(
            model=model_name, prompt="Answer:", max_tokens=60, extra_body=extra, **sampling
        )

    results = parallel(call, [(c[0], s) for c in cases for s in SAMPLINGS])
    for i, resp in enumerate(results):
        text = resp.choices[0].text
        assert cases[i // len(SAMPLINGS)][1](text), (cases[i // len(SAMPLINGS)][0], text)
    bad = {"prompt": "Hi", "max_tokens": 5, "structured_outputs": {"grammar": "root ::= (("}}
    assert_error(http.post("/v1/completions", json=bad), 400, "BadRequestError", "structured_outputs")


def test_agent_loop(client: openai.OpenAI, model_name):
    messages = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    first = client.chat.completions.create(
        model=model_name,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    [call] = first.choices[0].message.tool_calls
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    result = json.dumps({"temperature": 21, "sky": "clear"})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40, stream=True
        )
    )
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answer.strip()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}]},
            "tools.0.function.parameters",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        # Past OpenAI's limits, a schema or choice whose compile would hold a worker for minutes.
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": HUGE_ENUM}}},
            "response_format",
        ),
        ({"structured_outputs": {"choice": [f"c{i}" for i in range(1001)]}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "object", "properties": WIDE}}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"enum": ["x" * 60_000, "y" * 60_001]}}}, "structured_outputs"),
        (
            {"tools": [WEATHER | {"function": {"name": "f", "parameters": HUGE_ENUM}}], "tool_choice": "required"},
            "tools.0.function.parameters",
        ),
        # Nested counted repeats, whose masks would slow every stream's step.
        ({"structured_outputs": {"regex": "((a{1,100}){1,100}){1,100}"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),  # Python's re takes it, xgrammar not
        ({"structured_outputs": {"regex": r"(\w)\1"}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"structured_outputs": {"json": '{"type": "nope"}'}}, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        (
            {
                "structured_outputs": {"regex": "a"},
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "structured_outputs",
        ),
    ],
)
def test_invalid_tools_and_formats_are_refused(http, r, model_name, body, param):
    before = snapshot(r, model_name)
    resp = http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert_error(resp, 400, "BadRequestError", param)
    assert snapshot(r, model_name) == before


def test_grammar_the_engine_cannot_compile_fails_the_job_as_a_bad_request(http):
    resp = http.post(
        "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 5, "structured_outputs": {"grammar": "root ::= (("}},
    )
    assert_error(resp, 400, "BadRequestError", "structured_outputs")


def test_a_thinking_budget_for_a_model_without_a_reasoning_parser_fails_the_job_as_a_bad_request(http):
    # The default stack's worker has no CHATQ_REASONING_PARSER: vLLM refuses the field without --reasoning-parser.
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"})):
        resp = http.post(path, json=body | {"max_tokens": 4, "thinking_token_budget": 3})
        error = assert_error(resp, 400, "BadRequestError", "thinking_token_budget")
        assert "CHATQ_REASONING_PARSER" in error["message"]


ANSWER_TAG = {
    "type": "structural_tag",
    "format": {"type": "tag", "begin": "<answer>", "content": {"type": "regex", "pattern": "(yes|no)"}, "end": "</a>"},
}


def test_a_structural_tag_holds_chat_and_legacy_answers_streamed_and_whole(http, model_name):
    def answer(text: str) -> bool:
        return re.fullmatch(r"<answer>(yes|no)</a>", text) is not None

    chat = {"model": model_name, "messages": [{"role": "user", "content": "Is water wet?"}], "max_tokens": 40}
    legacy = {"model": model_name, "prompt": "Is water wet?", "max_tokens": 40}
    as_text = {"structured_outputs": {"structural_tag": json.dumps(ANSWER_TAG)}}
    cases = [
        ("/v1/chat/completions", chat | {"response_format": ANSWER_TAG}),
        ("/v1/chat/completions", chat | as_text | {"n": 2, "temperature": 1.0, "seed": 3}),
        ("/v1/completions", legacy | {"response_format": ANSWER_TAG}),
        ("/v1/completions", legacy | as_text),
    ]

    def whole(path, body):
        choices = http.post(path, json=body).json()["choices"]
        return [c["message"]["content"] if "message" in c else c["text"] for c in choices]

    def streamed(path, body):
        fs = stream(http, "POST", path, json=body | {"stream": True})
        key = "delta" if path.endswith("chat/completions") else None
        texts = {}
        for f in fs:
            for c in [] if f.data == "[DONE]" else f.json["choices"]:
                piece = (c["delta"].get("content") if key else c.get("text")) or ""
                texts[c["index"]] = texts.get(c["index"], "") + piece
        return [texts[i] for i in sorted(texts)]

    for got in parallel(lambda fn, case: fn(*case), [(fn, c) for fn in (whole, streamed) for c in cases]):
        assert got and all(answer(t) for t in got), got
    # xgrammar alone reads a format's kinds: one it does not know fails the job with a 400 naming the field.
    bad = chat | {"response_format": {"type": "structural_tag", "format": {"type": "no_such_kind"}}}
    error = assert_error(http.post("/v1/chat/completions", json=bad), 400, "BadRequestError", "response_format")
    assert "no_such_kind" in error["message"]
    shapeless = chat | {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}
    assert_error(http.post("/v1/chat/completions", json=shapeless), 400, "BadRequestError", "response_format")
