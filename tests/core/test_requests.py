"""The request models on their own: what a body reads as, before any service sees it."""

from __future__ import annotations

import json

import pytest

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.completion_request import CompletionRequest
from chatq.core.errors import BadRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def test_null_reads_as_left_out_where_a_field_cannot_be_null():
    body = {"messages": MESSAGES, "n": None, "stream": None, "min_tokens": None, "add_generation_prompt": None}
    req = ChatCompletionRequest.model_validate(body)
    assert (req.n, req.stream, req.min_tokens, req.add_generation_prompt) == (1, False, 0, True)
    # Where null means something it stays: a penalty left out takes the model's default, else OpenAI's.
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "presence_penalty": None})
    assert (
        req.sampling({"presence_penalty": 0.5})["presence_penalty"] == 0.5 and req.sampling({})["presence_penalty"] == 0
    )
    # A legacy completion's max_tokens null is "the room left", not 16.
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16


def test_a_function_with_null_parameters_takes_none():
    tool = {"type": "function", "function": {"name": "now", "parameters": None}}
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [tool]})
    req.check()
    assert req.tools is not None and req.tools[0].function.parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(?:ab)+c*?", r"[^\W\d]+", r"^(yes|no)$", r"\u00e9+"])
def test_regexes_in_the_grammar_engines_dialect_pass(pattern):
    ChatCompletionRequest.model_validate({"messages": MESSAGES, "structured_outputs": {"regex": pattern}}).check()


@pytest.mark.parametrize(
    ("pattern", "names"),
    [
        (r"(?<=a)b", "lookarounds"),
        (r"x(?!y)", "lookarounds"),
        (r"(a)\1", "backreferences"),
        (r"(a)?(?(1)b|c)", "conditional groups"),
        (r"\bword", "word boundaries"),
        (r"(?P<year>\d+)", "named groups"),
        (r"(?i)yes", "inline flags"),
        (r"(?i:yes)", "inline flags"),
        (r"a++", "possessive repeats"),
        (r"(?>a)", "atomic groups"),
        (r"(x|(y(?=z)))", "lookarounds"),
        (r"\A\d+\Z", "string anchors"),
        (r"a{,3}", "no lower bound"),
        (r"(?#note)a", "comments"),
        (r"(?u)a", "inline flags"),
        (r"[\N{DIGIT ONE}]", "named characters"),
        (r"(ab", "missing )"),
        ("(" * 1000 + ")" * 1000, "nested too deeply"),
    ],
)
def test_regexes_the_grammar_engine_cannot_compile_are_refused(pattern, names):
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "structured_outputs": {"regex": pattern}})
    with pytest.raises(BadRequest) as e:
        req.check()
    assert names in e.value.message and e.value.param == "structured_outputs"


def test_unhonoured_options_that_ask_for_nothing_pass_and_others_are_refused():
    harmless = {"disable_any_whitespace": False, "whitespace_pattern": None, "json_object": None}
    body = {
        "messages": MESSAGES,
        "modalities": [],
        "length_penalty": 1.0,
        "truncation_side": "left",
        "stream_interval": 1,
        "guided_json": None,
        "structured_outputs": {"regex": "a", **harmless},
    }
    ChatCompletionRequest.model_validate(body).check()
    for extra, param in (
        ({"modalities": ["audio"]}, "modalities"),
        ({"guided_json": {"type": "object"}}, "guided_json"),  # vLLM's older name: unconstrained output otherwise
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"logits_processors": ["my.module:Processor"]}, "logits_processors"),
        ({"truncation_side": "right"}, "truncation_side"),
        ({"stream_interval": 4}, "stream_interval"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
    ):
        with pytest.raises(BadRequest) as e:
            ChatCompletionRequest.model_validate({"messages": MESSAGES, **extra}).check()
        assert e.value.param == param


def test_stream_options_that_ask_for_nothing_pass_without_stream():
    # vLLM refuses stream options without stream only when they ask for something.
    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream_options={}).check()
    ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": None}
    ).check()
    with pytest.raises(BadRequest):
        ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], stream_options={"include_usage": False}
        ).check()


def test_text_and_refusal_parts_join_into_the_message_text():
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "hm"}, {"type": "output_text", "text": "c"}],
            },
        ]
    )
    assert [m.text() for m in req.messages] == ["a\nb", "no", "hm\nc"]
    for part in ({"type": "text", "text": 5}, {"type": "refusal"}, {"type": "input_audio", "input_audio": {}}):
        with pytest.raises(BadRequest):
            ChatCompletionRequest(messages=[{"role": "user", "content": [part]}]).messages[0].text()


def test_a_property_named_like_a_schema_keyword_is_just_a_name():
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"}, "contains": {"type": "string"}, "enum": {"type": "string"}},
        "allOf": [{"required": ["not"]}],
    }
    request = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}
    request["response_format"]["json_schema"] = {"name": "x", "schema": schema}
    ChatCompletionRequest(**request).check()


def test_a_tool_schema_needs_to_be_enforceable_only_where_a_grammar_holds_it():
    tools = [
        {"type": "function", "function": {"name": "tag", "parameters": {"type": "array", "uniqueItems": True}}},
        {"type": "function", "function": {"name": "plain", "parameters": {"type": "object"}}},
    ]
    messages = [{"role": "user", "content": "hi"}]
    for choice in ("auto", "none", {"type": "function", "function": {"name": "plain"}}):
        ChatCompletionRequest(messages=messages, tools=tools, tool_choice=choice).check()
    for choice in ("required", {"type": "function", "function": {"name": "tag"}}):
        with pytest.raises(BadRequest, match="cannot enforce uniqueItems") as e:
            ChatCompletionRequest(messages=messages, tools=tools, tool_choice=choice).check()
        assert e.value.param == "tools.0.function.parameters"


def test_schema_bounds_that_hold_a_value_pass():
    messages = [{"role": "user", "content": "hi"}]
    for schema in (
        {"type": "integer", "minimum": 1.0, "maximum": 3.0},
        {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 7},
        {"type": "number", "minimum": 5, "maximum": 5},
        {"type": "number", "exclusiveMinimum": 5, "exclusiveMaximum": 5.5},
        {"type": ["integer", "number"], "minimum": 1.5, "maximum": 1.7},
    ):
        ChatCompletionRequest(messages=messages, structured_outputs={"json": schema}).check()


def test_a_schema_given_as_text_is_read_as_strictly_as_a_body():
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest, match="not valid JSON") as e:
        ChatCompletionRequest(messages=messages, structured_outputs={"json": '{"maximum": 1e400}'}).check()
    assert e.value.param == "structured_outputs"


def test_a_schema_that_refers_to_itself_through_content_passes():
    tree = {"type": "object", "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}}}
    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], structured_outputs={"json": tree}).check()


def test_a_batch_of_one_legacy_prompt_is_that_prompt():
    assert CompletionRequest.model_validate({"prompt": ["Say hi"]}).prompt == "Say hi"
    assert CompletionRequest.model_validate({"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert CompletionRequest.model_validate({"prompt": [5]}).prompt == [5]  # one token id, not a batch


STRUCTURES = {"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f="]}
FORMAT = {"format": {"type": "triggered_tags", "triggers": ["<f="], "tags": []}}


@pytest.mark.parametrize("tag", [FORMAT, STRUCTURES])
def test_a_structural_tag_in_either_form_passes_in_either_field(tag):
    ChatCompletionRequest(messages=MESSAGES, response_format={"type": "structural_tag", **tag}).check()
    text = json.dumps({"type": "structural_tag", **tag})
    ChatCompletionRequest(messages=MESSAGES, structured_outputs={"structural_tag": text}).check()


@pytest.mark.parametrize(
    ("tag", "needle"),
    [
        ({}, "needs a `format` object"),
        ({"structures": STRUCTURES["structures"], "triggers": []}, "need `triggers`"),
        ({**STRUCTURES, "triggers": ["<g="]}, "starts with no trigger"),
        ({"format": {"type": "json_schema", "json_schema": {"type": "object", "uniqueItems": True}}}, "uniqueItems"),
    ],
)
def test_a_malformed_structural_tag_is_refused_naming_its_field(tag, needle):
    with pytest.raises(BadRequest, match=needle) as e:
        ChatCompletionRequest(messages=MESSAGES, response_format={"type": "structural_tag", **tag}).check()
    assert e.value.param == "response_format"
    for text in (json.dumps(tag), "[1]", "{not json"):
        with pytest.raises(BadRequest) as e:
            ChatCompletionRequest(messages=MESSAGES, structured_outputs={"structural_tag": text}).check()
        assert e.value.param == "structured_outputs"
