"""Parsers for tool calls forced by tool_choice, at every chunking."""

from __future__ import annotations

import json

import pytest

from chatq.worker.parse.forced import NamedToolParser, RequiredToolParser
from tests.helpers import collect


def chunkings(text: str):
    for size in range(1, 9):
        yield [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("args", ['{"city": "Paris", "days": 3}', "{}", '{"q": "naïve ☃"}'])
def test_named_call_streams_its_arguments(args):
    for pieces in chunkings(args):
        parser = NamedToolParser("get_weather")
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        firsts = [c for d in deltas for c in d.tool_calls if c.id is not None]
        assert len(firsts) == 1 and firsts[0].name == "get_weather" and firsts[0].id.startswith("chatcmpl-tool-")
        assert firsts[0].arguments == "" and deltas[0].tool_calls[0] is firsts[0]
        content, _, calls = collect(NamedToolParser("get_weather"), pieces)
        assert calls[0]["function"] == {"name": "get_weather", "arguments": args}
        assert content is None


def test_required_calls_are_read_from_the_array():
    text = json.dumps([{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}])
    for pieces in chunkings(text):
        content, _, calls = collect(RequiredToolParser(), pieces)
        assert content is None
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("a", {"x": 1}),
            ("b", {}),
        ]


def test_unfinished_required_array_stays_content():
    content, _, calls = collect(RequiredToolParser(), ['[{"name": "a", "param'])
    assert calls == [] and content == '[{"name": "a", "param'


def test_a_required_array_cut_short_keeps_the_call_it_was_writing_as_far_as_it_went():
    text = '[{"name": "a", "parameters": {"x": [1, 2]}}, {"name": "b", "parameters": {"q": "of'
    for pieces in chunkings(text):
        content, _, calls = collect(RequiredToolParser(), pieces)
        assert content is None
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("a", '{"x": [1, 2]}'),
            ("b", '{"q": "of'),
        ]
    content, _, calls = collect(RequiredToolParser(), [text[: text.index('"b"') + 2]])
    assert content is None and [c["function"]["name"] for c in calls] == ["a"]


def test_required_calls_stream_name_first_then_arguments():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    parser = RequiredToolParser()
    deltas = [parser.feed(c) for c in text]
    entries = [(text[: i + 1], c) for i, d in enumerate(deltas) for c in d.tool_calls]
    heads = [(seen[-15:], c.index, c.name, c.arguments) for seen, c in entries if c.id is not None]
    assert heads == [('"parameters": {', 0, "a", ""), ('"parameters": {', 1, "b", "")]
    assert [c.arguments for _, c in entries if c.id is None and c.index == 0] == ["{", '"', "x", '"', ": ", "1}"]
    assert not parser.finish()


@pytest.mark.parametrize("text", ["[1]", '[{"name": "a"}]', '[{"name": 3, "parameters": {}}]', "{}"])
def test_a_required_array_of_other_json_stays_content(text):
    assert collect(RequiredToolParser(), [text])[::2] == (text, [])
