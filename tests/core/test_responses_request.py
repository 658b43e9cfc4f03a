"""Responses requests as the chat requests their jobs run, and the chat request's errors in the Responses names."""

from __future__ import annotations

import pytest

from chatq.core import responses_request
from chatq.core.errors import BadRequest
from chatq.core.responses_request import ResponsesRequest


def test_a_tool_round_trip_becomes_the_chat_turns_it_stands_for():
    req = ResponsesRequest(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tool_choice={"type": "function", "name": "w"},
        tools=[{"type": "function", "name": "w"}],
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    )
    chat, _ = responses_request.chat_request(req, [], responses_request.input_items(req, "resp_abc"))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat.messages[2].tool_calls or []] == ["c1", "c2"]
    assert chat.forced_tool == "w" and chat.response_format is not None
    assert chat.response_format.json_schema is not None and chat.response_format.json_schema.name == "x"


def test_an_image_part_is_refused_by_name():
    req = ResponsesRequest(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(BadRequest) as e:
        responses_request.input_items(req, "resp_abc")
    assert e.value.param == "input[0].content[0].type"


def test_a_chat_field_is_named_by_the_responses_item_it_came_from():
    earlier = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c0", "name": "f", "arguments": "{}"},
    ]
    req = ResponsesRequest(input=[{"type": "function_call_output", "call_id": "c0", "output": "x"}], instructions="Hi")
    _, names = responses_request.chat_request(req, earlier, responses_request.input_items(req, "resp_abc"))
    # messages: the instructions, the earlier user turn, its call's assistant turn, this input's tool output.
    assert names.param("messages.0.content") == "instructions"
    assert names.param("messages.1") == "previous_response_id"
    assert names.param("messages.2.tool_calls.0.function.arguments") == "previous_response_id"
    assert names.param("messages.3.content") == "input[0].content"
    assert names.param("messages") == "input" and names.param("max_completion_tokens") == "max_output_tokens"
    assert names.param("response_format.json_schema") == "text.format" and names.param("top_p") == "top_p"
