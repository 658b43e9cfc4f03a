"""Tool calls and structured outputs with SmolLM2: constrained decoding keeps them valid every time."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import assert_error, running_stack, snapshot, stream

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
# Sampled over the whole distribution, whatever the model's generation defaults.
SAMPLINGS = [
    {"temperature": 0},
    {"temperature": 1.0, "top_p": 1.0, "seed": 1},
    {"temperature": 1.0, "top_p": 1.0, "seed": 2},
]


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


def streamed_calls(chunks: list, index: int) -> list:
    """The tool-call entries one choice's chunks carried, in order."""
    return [
        tc for c in chunks if c.choices and c.choices[0].index == index for tc in c.choices[0].delta.tool_calls or []
    ]


def assert_streamed_as(entries: list, calls: list[dict]) -> None:
    """Each call streamed as vLLM streams it: its id, type and name first with no arguments yet, then its arguments
    in more than one fragment, which join to the whole call's."""
    assert calls
    for i, call in enumerate(calls):
        mine = [e for e in entries if e.index == i]
        head, fragments = mine[0], mine[1:]
        assert (head.id, head.type, head.function.name, head.function.arguments) == (
            call["id"],
            "function",
            call["function"]["name"],
            "",
        )
        assert all(f.id is None and f.type is None and f.function.name is None for f in fragments)
        assert len(fragments) > 1 and "".join(f.function.arguments for f in fragments) == call["function"]["arguments"]


def calls_of(message) -> list[tuple[str, str]]:
    return [(tc.function.name, tc.function.arguments) for tc in message.tool_calls]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_forced_calls_stream_name_first_then_arguments_as_the_whole_answer_has_them(
    client: openai.OpenAI, http, model_name, tool_choice
):
    kw = dict(
        model=model_name,
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=60,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        n=2,
        temperature=1.0,
        seed=11,
    )
    chunks = list(client.chat.completions.create(stream=True, **kw))
    stored = http.get(f"/v1/chat/completions/{chunks[0].id}").json()
    whole = client.chat.completions.create(**kw)
    for choice in whole.choices:
        record = stored["choices"][choice.index]["message"]
        assert_streamed_as(streamed_calls(chunks, choice.index), record["tool_calls"])
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in record["tool_calls"]] == calls_of(
            choice.message
        )
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert finish[-1] == choice.finish_reason == stored["choices"][choice.index]["finish_reason"]


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, httpx.Client]]:
    """A stack whose worker reads the model's own calls with the hermes parser."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("hermes-redis"), persist=False).start()
    settings = Settings(redis_url=server.url, api_port=free_port(), sse_keepalive=0.25)
    logs = tmp_path_factory.mktemp("hermes-logs")
    try:
        with running_stack(settings, logs, {"CHATQ_TOOL_PARSER": "hermes"}) as base, httpx.Client(timeout=120) as http:
            http.base_url = httpx.URL(base)
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120), http
    finally:
        server.stop()


# The model writes a hermes call when its output is held to one, as a model trained on them would write it.
HERMES_CALL = (
    r"Sure\.\n<tool_call>\n\{\"name\": \"get_weather\", \"arguments\": \{\"city\": \"[A-Z][a-z]{2,8}\", "
    r"\"unit\": \"(celsius|fahrenheit)\"\}\}\n</tool_call>"
)


def test_auto_calls_stream_name_first_then_arguments_as_the_whole_answer_has_them(hermes, model_name):
    client, http = hermes
    kw = dict(
        model=model_name,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=80,
        n=2,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    chunks = list(client.chat.completions.create(stream=True, **kw))
    stored = http.get(f"/v1/chat/completions/{chunks[0].id}").json()
    whole = client.chat.completions.create(**kw)
    for choice in whole.choices:
        record = stored["choices"][choice.index]
        assert_streamed_as(streamed_calls(chunks, choice.index), record["message"]["tool_calls"])
        assert calls_of(choice.message) == [
            (c["function"]["name"], c["function"]["arguments"]) for c in record["message"]["tool_calls"]
        ]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == choice.index)
        assert content == choice.message.content == record["message"]["content"] == "Sure.\n"
        assert choice.finish_reason == record["finish_reason"] == "tool_calls"
        jsonschema.validate(
            json.loads(choice.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"]
        )


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


def strict(tool: dict) -> dict:
    return tool | {"function": tool["function"] | {"strict": True}}


# Calls the model saw itself make, so that it makes one again; the arguments it then writes are its own.
SHOWN_CALLS = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'
        "\n</tool_call>",
    },
    {"role": "tool", "content": '{"celsius": 24}'},
    {"role": "assistant", "content": "It is 24 degrees in Rome."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def test_strict_tools_under_auto_hold_the_models_own_call_to_its_schema(hermes, model_name):
    client, http = hermes
    # A schema unlike the call the model was shown: left free, it writes that call's arguments again.
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["FR", "IT"]}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    weather = {"type": "function", "function": WEATHER["function"] | {"parameters": schema}}
    kw = dict(model=model_name, messages=SHOWN_CALLS, max_tokens=60, temperature=0)
    free = client.chat.completions.create(tools=[weather, TIME], **kw).choices[0]
    [call] = free.message.tool_calls
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(call.function.arguments), schema)

    held = client.chat.completions.create(tools=[strict(weather), TIME], **kw).choices[0]
    assert held.finish_reason == "tool_calls"
    [call] = held.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    chunks = list(client.chat.completions.create(tools=[strict(weather), TIME], stream=True, **kw))
    stored = http.get(f"/v1/chat/completions/{chunks[0].id}").json()["choices"][0]["message"]["tool_calls"]
    assert_streamed_as(streamed_calls(chunks, 0), stored)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in stored] == calls_of(held.message)


def test_strict_tools_under_auto_are_refused_by_name_without_a_parser_that_can_hold_them(http):
    body = {"messages": ASK, "max_tokens": 5, "tools": [TIME, strict(WEATHER)]}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "BadRequestError", "tools.1.function.strict")
    resp = http.post("/v1/chat/completions", json=body | {"tool_choice": "required"})
    assert resp.status_code == 200
