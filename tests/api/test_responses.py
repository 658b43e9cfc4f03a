"""The Responses API through the official SDK, against the real stack: each response a chat job on the queue."""

from __future__ import annotations

import json
import time
import uuid

import jsonschema
import openai
import pytest
import redis
from openai.types.responses import Response, ResponseItemList

from chatq.core import keys
from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.job import Job, JobStatus
from chatq.core.responses_request import ResponsesRequest
from tests.api.conftest import KEY_A, KEY_B, Guarded
from tests.helpers import stream

ASK = "Count from 1 to 100, one number per line."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}


IMAGE_PARAM = "input[0].content[0].type"


def wait_until(client: openai.OpenAI, response_id: str, statuses: set[str], timeout: float = 120) -> Response:
    deadline = time.monotonic() + timeout
    while True:
        resp = client.responses.retrieve(response_id)
        if resp.status in statuses or time.monotonic() > deadline:
            return resp
        time.sleep(0.1)


def test_a_response_answers_with_its_text_and_usage(client: openai.OpenAI):
    resp = client.responses.create(input="Say hello.", instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status in ("completed", "incomplete") and resp.output_text
    assert resp.output[0].type == "message" and resp.output[0].content[0].type == "output_text"
    assert resp.usage is not None and 0 < resp.usage.output_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 8
    if resp.status == "completed":
        assert resp.completed_at is not None and resp.completed_at >= resp.created_at
    assert client.responses.retrieve(resp.id).output_text == resp.output_text


def test_the_sdk_request_id_is_the_response_id(client: openai.OpenAI):
    resp = client.responses.create(input="Hi", max_output_tokens=2)
    queued = client.responses.create(input="Hi", max_output_tokens=2, background=True)
    assert (resp._request_id, queued._request_id) == (resp.id, queued.id)
    with client.responses.create(input="Hi", max_output_tokens=2, stream=True) as stream:
        events = list(stream)
        assert stream.response.headers["x-request-id"] == events[0].response.id


def test_running_out_of_tokens_is_incomplete(client: openai.OpenAI):
    resp = client.responses.create(input=ASK, max_output_tokens=4, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in resp.output] == ["incomplete"]  # its text was cut short too
    final = list(client.responses.create(input=ASK, max_output_tokens=4, temperature=0, stream=True))
    done = [e.item.status for e in final if e.type == "response.output_item.done"]
    assert done == ["incomplete"] and final[-1].response.output[0].status == "incomplete"


def test_a_stream_sends_the_typed_events_in_order(client: openai.OpenAI):
    events = list(client.responses.create(input="Say hello.", max_output_tokens=6, temperature=0, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text
    assert client.responses.retrieve(events[0].response.id).output_text == text


def test_the_stream_helper_gets_the_final_response(client: openai.OpenAI, model_name: str):
    with client.responses.stream(model=model_name, input="Say hello.", max_output_tokens=40, temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text
    assert [item.status for item in final.output] == ["completed"]


def test_a_background_response_resumes_where_its_stream_stopped(client: openai.OpenAI):
    resp = client.responses.create(input=ASK, max_output_tokens=24, temperature=0, background=True)
    assert resp.status in ("queued", "in_progress") and resp.background is True
    first = []
    with client.responses.retrieve(resp.id, stream=True) as stream:
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta" and len(first) > 6:
                break
    cut = first[-1].sequence_number
    rest = list(client.responses.retrieve(resp.id, stream=True, starting_after=cut))
    assert [e.sequence_number for e in rest] == list(range(cut + 1, cut + 1 + len(rest)))  # no repeats, no gaps
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert rest[-1].type == "response.incomplete" and rest[-1].response.output_text == text
    assert client.responses.retrieve(resp.id).output_text == text


def test_cancel_is_idempotent_and_the_stream_ends(client: openai.OpenAI):
    resp = client.responses.create(input=ASK, max_output_tokens=400, temperature=0, background=True)
    wait_until(client, resp.id, {"in_progress"})
    cancelled = client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled"
    again = client.responses.cancel(resp.id)
    assert again.status == "cancelled" and again.output_text == cancelled.output_text
    events = list(client.responses.retrieve(resp.id, stream=True))
    assert events[-1].response.status == "cancelled"  # a resumed stream of a cancelled response ends
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    assert [item.status for item in cancelled.output] == ["incomplete"]


def test_delete_removes_the_response(client: openai.OpenAI):
    resp = client.responses.create(input="Hi", max_output_tokens=2)
    deleted = client.responses.delete(resp.id)
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"include": ["file_search_call.results", "everything"]}, "include[1]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, IMAGE_PARAM),
    ],
)
def test_unsupported_fields_are_refused_by_name(client: openai.OpenAI, extra: dict, param: str):
    body = {"input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.status_code == 400 and e.value.param == param
    assert "Input should be" not in e.value.body["message"]  # type: ignore[index]  # says what chatq lacks


def test_an_include_naming_outputs_chatq_never_makes_is_accepted(client: openai.OpenAI):
    resp = client.responses.create(input="Hi", max_output_tokens=2, include=["web_search_call.results"])
    assert resp.status in ("completed", "incomplete")


def test_an_output_with_no_call_before_it_is_refused(client: openai.OpenAI):
    lost = [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "nowhere", "output": "x"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=lost, max_output_tokens=2)
    assert e.value.param == "input[1].call_id" and "nowhere" in e.value.body["message"]  # type: ignore[index]


CALLED = [
    {"role": "user", "content": "Hi"},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "not json"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"uniqueItems": True}}}}, "text.format"),
        ({"tools": [WEATHER | {"parameters": {"not": {}}}], "tool_choice": "required"}, "tools[0].parameters"),
        ({"input": CALLED, "instructions": "Be brief."}, "input[1].arguments"),
    ],
)
def test_an_invalid_field_is_named_as_the_responses_api_names_it(client: openai.OpenAI, extra: dict, param: str):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"input": "Hi"} | extra)
    assert e.value.status_code == 400 and e.value.param == param
    message = e.value.body["message"]  # type: ignore[index]
    assert not any(chat in message for chat in ("max_completion_tokens", "response_format", "messages."))


def test_a_json_schema_format_holds(client: openai.OpenAI):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}},
        "required": ["colour", "sure"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        input="Pick a colour.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_a_tool_round_trip_with_previous_response_id(client: openai.OpenAI):
    first = client.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        temperature=0,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments)
    second = client.responses.create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER],
        max_output_tokens=12,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    items = client.responses.input_items.list(second.id).data
    assert [i.type for i in items] == ["function_call_output"]


def test_previous_response_id_carries_the_conversation(client: openai.OpenAI):
    first = client.responses.create(input="My name is Zorblax.", max_output_tokens=4, temperature=0)
    second = client.responses.create(previous_response_id=first.id, input="Hi", max_output_tokens=2, temperature=0)
    # The earlier input and output are this one's prompt: it counts more input tokens than its own message.
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(previous_response_id="resp_nothing", input="Hi", max_output_tokens=2)


def test_tool_choice_required_forces_a_call(client: openai.OpenAI):
    resp = client.responses.create(
        input="Weather in Rome?", tools=[WEATHER], tool_choice="required", max_output_tokens=80, temperature=0
    )
    assert [o.type for o in resp.output][-1] == "function_call"


def test_a_streamed_tool_call_comes_whole_to_the_stream_helper(client: openai.OpenAI, model_name: str):
    with client.responses.stream(
        model=model_name,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    call = final.output[-1]
    assert call.type == "function_call" and done and done[0].arguments == args == call.arguments
    assert "city" in json.loads(args)


def test_another_keys_response_is_not_found(guarded: Guarded):
    with guarded.client(KEY_A) as a, guarded.client(KEY_B) as b:
        resp = a.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "background": True})
        assert resp.status_code == 200, resp.text
        rid = resp.json()["id"]
        assert b.get(f"/v1/responses/{rid}").status_code == 404
        assert b.post(f"/v1/responses/{rid}/cancel").status_code == 404
        assert b.post("/v1/responses", json={"input": "Hi", "previous_response_id": rid}).status_code == 404
        assert a.get(f"/v1/responses/{rid}").json()["id"] == rid
        assert a.delete(f"/v1/responses/{rid}").json()["deleted"] is True


def test_objects_validate_strictly_as_the_sdks_types(client: openai.OpenAI):
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    raw = client.responses.with_raw_response.create(input=conversation, max_output_tokens=2)
    resp = Response.model_validate(raw.http_response.json(), strict=True)
    assert resp.reasoning is not None and resp.reasoning.effort is None  # echoed as OpenAI echoes it left out
    listed = client.responses.input_items.with_raw_response.list(resp.id).http_response.json()
    items = ResponseItemList.model_validate(listed, strict=True).data
    assert [getattr(i, "role", None) for i in items] == ["user", "assistant", "user"]


def test_a_stream_opens_queued_only_in_the_background(client: openai.OpenAI):
    now = next(iter(client.responses.create(input="Hi", max_output_tokens=2, stream=True)))
    later = next(iter(client.responses.create(input="Hi", max_output_tokens=2, stream=True, background=True)))
    assert now.type == later.type == "response.created"
    assert (now.response.status, later.response.status) == ("in_progress", "queued")


def test_the_chat_routes_do_not_serve_a_response(client: openai.OpenAI, http):
    resp = client.responses.create(input="Hi", max_output_tokens=2)
    assert http.get(f"/v1/chat/completions/{resp.id}").status_code == 404
    assert http.get(f"/v1/chat/completions/{resp.id}?stream=true").status_code == 404
    assert http.post(f"/v1/chat/completions/{resp.id}/cancel").status_code == 404
    assert http.delete(f"/v1/chat/completions/{resp.id}").status_code == 404
    assert client.responses.retrieve(resp.id).output_text == resp.output_text


def test_a_log_entry_the_relay_cannot_read_ends_the_stream_with_an_error_event(http, r: redis.Redis, model_name: str):
    # A running response whose log holds an entry no version of chatq wrote: the relay fails on it.
    job = Job(
        id=f"resp_{uuid.uuid4().hex}",
        model=model_name,
        kind="response",
        request=ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}]),
        status=JobStatus.in_progress,
        response={"request": ResponsesRequest(input="Hi").echo(), "input": [], "context": []},
    )
    r.hset(keys.job(job.id), mapping=job.to_redis())
    r.xadd(keys.events(job.id), {"msg": "not an event"}, id="0-1")
    try:
        events = [f.json for f in stream(http, "GET", f"/v1/responses/{job.id}", params={"stream": "true"})]
        # The stream ends, not hangs, and says why, numbered after the last event sent; the job goes on.
        assert [(e["type"], e["sequence_number"]) for e in events] == [("response.created", 0), ("error", 1)]
        assert events[1]["code"] == "server_error" and "resume the stream" in events[1]["message"]
        assert r.hget(keys.job(job.id), "status") == "in_progress"
    finally:
        r.delete(keys.job(job.id), keys.events(job.id))
