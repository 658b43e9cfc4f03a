"""Bad requests get OpenAI-shaped errors and change nothing."""

from __future__ import annotations

import openai
import pytest

from chatq.core import keys
from tests.helpers import assert_error, snapshot

OK_MESSAGES = [{"role": "user", "content": "hi"}]


M = OK_MESSAGES
LONG_PROMPT = [{"role": "user", "content": "hello " * 9000}]
BAD = "BadRequestError"

# Each invalid request of the reference contract: (body, status, error type, param).
INVALID = [
    ({"model": "gpt-9", "messages": M}, 404, "NotFoundError", "model"),
    ({"model": "gpt-9", "messages": M, "stream": True}, 404, "NotFoundError", "model"),
    ({}, 400, BAD, "messages"),
    ({"messages": []}, 400, BAD, "messages"),
    ({"messages": [{"content": "x"}]}, 400, BAD, "messages.0.role"),
    ({"messages": M, "cache_salt": ""}, 400, BAD, "cache_salt"),
    ({"messages": M, "cache_salt": "tenant/a"}, 400, BAD, "cache_salt"),
    ({"messages": M, "cache_salt": "s" * 129}, 400, BAD, "cache_salt"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        BAD,
        "messages",
    ),
    ({"messages": M, "temperature": 3}, 400, BAD, "temperature"),
    ({"messages": M, "temperature": -0.5}, 400, BAD, "temperature"),
    ({"messages": M, "top_p": 0}, 400, BAD, "top_p"),
    ({"messages": M, "top_p": 1.5}, 400, BAD, "top_p"),
    ({"messages": M, "top_k": -2}, 400, BAD, "top_k"),
    ({"messages": M, "min_p": 1.5}, 400, BAD, "min_p"),
    ({"messages": M, "n": 0}, 400, BAD, "n"),
    ({"messages": M, "n": 2, "temperature": 0}, 400, BAD, "n"),
    ({"messages": M, "max_tokens": 0}, 400, BAD, "max_tokens"),
    ({"messages": M, "max_completion_tokens": 0}, 400, BAD, "max_completion_tokens"),
    ({"messages": M, "max_tokens": 10**6}, 400, BAD, "max_tokens"),
    ({"messages": M, "max_completion_tokens": 10**6, "max_tokens": 5}, 400, BAD, "max_completion_tokens"),
    ({"messages": M, "min_tokens": 10, "max_tokens": 5}, 400, BAD, "min_tokens"),
    ({"messages": M, "stop": ["a", "b", "c", "d", "e"]}, 400, BAD, "stop"),
    ({"messages": M, "stop": [""]}, 400, BAD, "stop"),
    ({"messages": M, "seed": 2**64}, 400, BAD, "seed"),
    ({"messages": M, "presence_penalty": 2.5}, 400, BAD, "presence_penalty"),
    ({"messages": M, "frequency_penalty": -2.5}, 400, BAD, "frequency_penalty"),
    ({"messages": M, "repetition_penalty": 0}, 400, BAD, "repetition_penalty"),
    ({"messages": M, "logit_bias": {"abc": 1, "12": 2, "x": 3}}, 400, BAD, "logit_bias"),
    ({"messages": M, "logit_bias": {"99999999": 1}}, 400, BAD, "logit_bias"),
    ({"messages": M, "top_logprobs": 3}, 400, BAD, "top_logprobs"),
    ({"messages": M, "logprobs": True, "top_logprobs": 21}, 400, BAD, "top_logprobs"),
    ({"messages": M, "stream_options": {"include_usage": True}}, 400, BAD, "stream_options"),
    ({"messages": M, "stop_token_ids": [10**8]}, 400, BAD, "stop_token_ids"),
    ({"messages": M, "reasoning_effort": "extreme"}, 400, BAD, "reasoning_effort"),
    ({"messages": M, "continue_final_message": True}, 400, BAD, "continue_final_message"),
    (
        {
            "messages": [*M, {"role": "assistant", "content": "x"}],
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        400,
        BAD,
        "continue_final_message",
    ),
    ({"messages": M, "truncate_prompt_tokens": 0}, 400, BAD, "truncate_prompt_tokens"),
    ({"messages": M, "truncate_prompt_tokens": 10**6}, 400, BAD, "truncate_prompt_tokens"),
    ({"messages": LONG_PROMPT}, 400, BAD, "input_tokens"),
    ({"messages": M, "audio": {"voice": "x"}}, 400, BAD, "audio"),
    ({"messages": M, "bad_words": ["hi", ""]}, 400, BAD, "bad_words"),
    ({"messages": M, "allowed_token_ids": [1, 2, 10**9]}, 400, BAD, "allowed_token_ids"),
    ({"messages": M, "chat_template": "{{ messages }}"}, 400, BAD, "chat_template"),
    ({"messages": M, "use_beam_search": True, "n": 2, "stop": ["."]}, 400, BAD, "stop"),
    ({"messages": M, "n": 2, "best_of": 1, "temperature": 1}, 400, BAD, "best_of"),
    ({"messages": M, "spaces_between_special_tokens": False}, 400, BAD, "spaces_between_special_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, BAD, "messages.0.content"),
    (
        {
            "messages": [
                *M,
                {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{x"}}]},
            ]
        },
        400,
        BAD,
        "messages.1.tool_calls.0.function.arguments",
    ),
    ({"messages": M, "request_id": "abc:events"}, 400, BAD, "request_id"),
    ({"messages": M, "request_id": "x" * 129}, 400, BAD, "request_id"),
    ({"messages": M, "n": 129, "temperature": 1}, 400, BAD, "n"),
    # A text part's text must be text: null would reach the template as the word "None".
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, 400, BAD, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, BAD, "messages"),
    ({"messages": M, "chat_template_kwargs": {"messages": []}}, 400, BAD, "chat_template_kwargs"),
    (
        {"messages": M, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
        400,
        BAD,
        "response_format.json_schema.name",
    ),
]

# Schemas valid as JSON Schema that the grammar engine cannot compile: each a 400 up front, never a failed job.
UNCOMPILABLE_SCHEMAS = [
    {"type": "string", "pattern": "(?<=a)b"},
    {"type": "string", "pattern": "(a)\\1"},
    {"type": "object", "patternProperties": {"(?=x)": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    {"type": "object", "properties": {"a": {"$ref": "https://example.com/schema"}}},
    {"enum": []},
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "array", "minItems": 3, "maxItems": 2},
    {"type": "string", "minLength": 3, "maxLength": 2},
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 6},
    {"type": "number", "minimum": 5, "exclusiveMaximum": 5},
    {"type": "integer", "minimum": 1.5, "maximum": 3},
    {"type": "integer", "maximum": -1e20},
    {"type": "string", "pattern": "\\101"},
    # Compiled, but not enforced: the grammar would let through what these forbid.
    {"type": "object", "allOf": [{"required": ["a"]}, {"required": ["b"]}]},
    {"type": "array", "uniqueItems": True},
    {"type": "object", "properties": {"n": {"not": {"const": 3}}}},
    {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}},
    {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    {"type": "object", "dependentRequired": {"a": ["b"]}},
]


@pytest.mark.parametrize(("body", "status", "type_", "param"), INVALID)
def test_invalid_request_is_refused_and_enqueues_nothing(http, r, model_name, body, status, type_, param):
    before = snapshot(r, model_name)
    assert_error(http.post("/v1/chat/completions", json=body), status, type_, param)
    assert snapshot(r, model_name) == before


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 5}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "logprobs": 30}, "logprobs"),
        ({"prompt": [10**8]}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_invalid_text_completion_is_refused(http, r, model_name, body, param):
    before = snapshot(r, model_name)
    assert_error(http.post("/v1/completions", json=body), 400, BAD, param)
    assert snapshot(r, model_name) == before


@pytest.mark.parametrize("schema", UNCOMPILABLE_SCHEMAS)
@pytest.mark.parametrize("where", ["response_format", "structured_outputs", "tools"])
def test_a_schema_the_grammar_engine_cannot_compile_is_a_400(http, r, model_name, schema, where):
    body: dict = {"messages": M, "background": True}
    if where == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        param = "response_format"
    elif where == "structured_outputs":
        body["structured_outputs"] = {"json": schema}
        param = "structured_outputs"
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required"
        param = "tools.0.function.parameters"
    before = snapshot(r, model_name)
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, BAD, param)
    assert error["message"].startswith("Invalid JSON schema")
    assert snapshot(r, model_name) == before


def test_a_schema_nested_beyond_reason_is_a_400(http, r, model_name):
    schema: dict = {"type": "string"}
    for _ in range(400):
        schema = {"type": "array", "items": schema}
    body = {"messages": M, "structured_outputs": {"json": schema}}
    before = snapshot(r, model_name)
    assert_error(http.post("/v1/chat/completions", json=body), 400, BAD, "structured_outputs")
    assert snapshot(r, model_name) == before


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"12": Infinity}}',
        b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": NaN}',
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 1100 + b"]" * 1100 + b"}",
    ],
)
def test_what_is_not_strict_json_is_a_400(http, r, model_name, raw):
    # Python's json takes NaN, Infinity, overflowing numbers and unpaired surrogates; nothing after it could store
    # or encode them (a job stored with null in their place, a tokenizer error).
    before = snapshot(r, model_name)
    resp = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_error(resp, 400, BAD, None)
    assert error["message"].startswith("The request body is not valid JSON: ")
    assert snapshot(r, model_name) == before


def test_a_body_nested_deeper_than_a_job_can_store_is_a_400(http, r, model_name):
    before = snapshot(r, model_name)
    nested: list = []
    for _ in range(900):
        nested = [nested]
    resp = http.post("/v1/chat/completions", json={"messages": M, "vendor_field": nested})
    assert_error(resp, 400, BAD, None)
    assert snapshot(r, model_name) == before


def test_logit_bias_error_lists_every_bad_key(http):
    body = {"messages": M, "logit_bias": {"abc": 1, "12": 2, "99999999": 3, "x": 4}}
    message = http.post("/v1/chat/completions", json=body).json()["error"]["message"]
    assert "'abc'" in message and "'99999999'" in message and "'x'" in message and "'12'" not in message


def test_too_long_prompt_says_how_long(http):
    message = http.post("/v1/chat/completions", json={"messages": LONG_PROMPT}).json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 8192 tokens. However, your prompt contains ")


def test_malformed_json_is_a_400(http, r, model_name):
    before = snapshot(r, model_name)
    resp = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(resp, 400, "BadRequestError", None)
    assert snapshot(r, model_name) == before


def test_an_empty_body_is_a_400_that_says_so(http, r, model_name):
    before = snapshot(r, model_name)
    resp = http.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert_error(resp, 400, "BadRequestError", None)
    assert resp.json()["error"]["message"] == "The request body is missing."
    assert snapshot(r, model_name) == before


@pytest.mark.parametrize(
    ("raw", "content_type"),
    [(b"[1]", "application/json"), (b"null", "application/json"), (b'{"messages": []}', "text/plain")],
)
def test_a_body_that_is_no_json_object_is_a_400_that_says_so(http, r, model_name, raw, content_type):
    before = snapshot(r, model_name)
    resp = http.post("/v1/chat/completions", content=raw, headers={"content-type": content_type})
    assert_error(resp, 400, "BadRequestError", None)
    assert "must be a JSON object" in resp.json()["error"]["message"]
    assert snapshot(r, model_name) == before


def test_a_request_id_header_is_checked_like_the_field(http, r, model_name):
    before = snapshot(r, model_name)
    resp = http.post("/v1/chat/completions", json={"messages": M}, headers={"X-Request-Id": "a:b"})
    assert_error(resp, 400, BAD, "request_id")
    assert snapshot(r, model_name) == before


def test_tokenize_without_messages_is_a_400(http):
    assert_error(http.post("/tokenize", json={"messages": []}), 400, BAD, "messages")


@pytest.mark.parametrize(("method", "suffix"), [("GET", ""), ("POST", "/cancel"), ("DELETE", "")])
@pytest.mark.parametrize("job_id", ["chatcmpl-doesnotexist", "chatcmpl-keyclash:events"])
def test_unknown_job_id_is_a_404(http, r, method, suffix, job_id):
    # The second names another job's event log, were ids put into key names unchecked.
    r.xadd(keys.events("chatcmpl-keyclash"), {"msg": "{}"})
    resp = http.request(method, f"/v1/chat/completions/{job_id}{suffix}")
    assert_error(resp, 404, "NotFoundError", "completion_id")


def test_sdk_raises_typed_errors(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=OK_MESSAGES)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=OK_MESSAGES, top_p=0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve("chatcmpl-missing")


def test_health_names_what_is_up(http):
    body = http.get("/health").json()
    assert body["status"] == "ok" and body["models"]["SmolLM2-135M-Instruct"] >= 1


def test_a_route_answers_a_method_it_does_not_take_with_the_ones_it_does(http):
    resp = http.get("/v1/completions")
    assert resp.status_code == 405 and resp.json()["error"]["type"] == "MethodNotAllowedError"
    assert resp.headers["allow"] == "POST"


def test_a_validators_message_reads_as_written(http):
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": list("abcde")}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, BAD, "stop")
    assert error["message"].startswith("stop may hold at most 4 sequences")


def test_only_the_winning_token_limit_is_checked(client: openai.OpenAI, model_name):
    messages = [{"role": "user", "content": "Hi"}]
    resp = client.chat.completions.create(model=model_name, messages=messages, max_tokens=0, max_completion_tokens=3)
    assert resp.usage.completion_tokens <= 3
