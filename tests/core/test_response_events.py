"""Chat chunks as the Responses stream's events, whose items are the stored Response's."""

from __future__ import annotations

from chatq.core import response_object
from chatq.core.job import Event, EventKind
from chatq.core.response_events import ResponseEvents


def chunk(seq: int, delta: dict, finish: str | None = None) -> Event:
    return Event(seq, EventKind.chunk, {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


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
    assert response_object.output_items("resp_abc", result) == done


def _call() -> dict:
    return {"id": "chatcmpl-tool-9", "function": {"name": "w", "arguments": "{}"}}
