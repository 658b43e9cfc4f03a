"""Responses requests as the chat requests their jobs run, and chat chunks as the Responses stream's events."""

from __future__ import annotations

import pytest

from chatq.core import responses
from chatq.core.errors import BadRequest
from chatq.core.job import Event, EventKind
from chatq.core.responses import ResponseEvents, ResponsesRequest


def chunk(seq: int, delta: dict, finish: str | None = None) -> Event:
    return Event(seq, EventKind.chunk, {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


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
    chat, _ = responses.chat_request(req, [], responses.input_items(req, "resp_abc"))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat.messages[2].tool_calls or []] == ["c1", "c2"]
    assert chat.forced_tool == "w" and chat.response_format is not None
    assert chat.response_format.json_schema is not None and chat.response_format.json_schema.name == "x"


def test_an_image_part_is_refused_by_name():
    req = ResponsesRequest(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(BadRequest) as e:
        responses.input_items(req, "resp_abc")
    assert e.value.param == "input[0].content[0].type"


def test_reasoning_text_and_a_call_stream_as_three_items_numbered_in_order():
    events = ResponseEvents("resp_abc")
    snapshot = {"id": "resp_abc", "status": "in_progress"}
    out = events.opening(snapshot)
    log = [
        chunk(1, {"role": "assistant", "content": ""}),
        chunk(2, {"reasoning": "hm"}),
        chunk(3, {"content": "Hi"}),
        chunk(4, {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-9", "function": {"name": "w", "arguments": "{"}}]}),
        chunk(5, {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}),
        chunk(6, {}, "tool_calls"),
        Event(7, EventKind.done),
    ]
    for e in log:
        out += events.feed(e, snapshot)
    assert events.ended
    out += events.terminal({"status": "completed"})
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    added = [e["item"]["type"] for e in out if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert added == ["reasoning", "message", "function_call"] and [d["type"] for d in done] == added
    assert done[2]["arguments"] == "{}" and done[2]["id"] == "fc_9" and done[1]["content"][0]["text"] == "Hi"
    assert out[-1]["type"] == "response.completed"
    # The stored result's items are the streamed ones.
    message = {"reasoning": "hm", "content": "Hi", "tool_calls": [_call()]}
    result = {"choices": [{"message": message, "finish_reason": "tool_calls"}]}
    assert responses.output_items("resp_abc", result) == done


def _call() -> dict:
    return {"id": "chatcmpl-tool-9", "function": {"name": "w", "arguments": "{}"}}


def test_a_chat_field_is_named_by_the_responses_item_it_came_from():
    earlier = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c0", "name": "f", "arguments": "{}"},
    ]
    req = ResponsesRequest(input=[{"type": "function_call_output", "call_id": "c0", "output": "x"}], instructions="Hi")
    _, names = responses.chat_request(req, earlier, responses.input_items(req, "resp_abc"))
    # messages: the instructions, the earlier user turn, its call's assistant turn, this input's tool output.
    assert names.param("messages.0.content") == "instructions"
    assert names.param("messages.1") == "previous_response_id"
    assert names.param("messages.2.tool_calls.0.function.arguments") == "previous_response_id"
    assert names.param("messages.3.content") == "input[0].content"
    assert names.param("messages") == "input" and names.param("max_completion_tokens") == "max_output_tokens"
    assert names.param("response_format.json_schema") == "text.format" and names.param("top_p") == "top_p"


def test_a_failed_responses_error_is_coded_as_openai_codes_it():
    refused = responses.response_error({"type": "BadRequestError", "message": "bad schema", "code": 400})
    lost = responses.response_error({"type": "InternalServerError", "message": "worker lost", "code": 500})
    assert refused == {"code": "invalid_prompt", "message": "bad schema"}
    assert lost == {"code": "server_error", "message": "worker lost"}
