"""What every tool parser shares: arguments written back as JSON, and model output too odd to be a call."""

from __future__ import annotations

import json

import orjson
import pytest

from chatq.worker.parse.common import arguments_json
from chatq.worker.parse.forced import RequiredToolParser
from chatq.worker.parse.hermes import HermesParser
from chatq.worker.parse.llama3_json import Llama3JsonParser
from chatq.worker.parse.pythonic import PythonicParser
from tests.helpers import collect


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (HermesParser, '<tool_call>{"name": "f", "arguments": {"s": "\\ud83d!"}}</tool_call>'),
        (Llama3JsonParser, '{"name": "f", "parameters": {"s": "\\ud83d!"}}'),
        (RequiredToolParser, '[{"name": "f", "parameters": {"s": "\\ud83d!"}}]'),
        (PythonicParser, '[f(s="\\ud83d!")]'),
    ],
)
def test_a_lone_surrogate_escape_in_arguments_stays_an_escape(make, text):
    # Decoded, "\ud83d" is a string no UTF-8 encoder takes: the worker's writes for the whole step would fail on it.
    _, _, calls = collect(make(), [text])
    arguments = calls[0]["function"]["arguments"]
    assert json.loads(arguments) == {"s": "\ud83d!"}
    orjson.dumps(calls)  # what publishing does with it


def test_arguments_are_written_unescaped_otherwise():
    assert arguments_json({"city": "Zürich ☃"}) == '{"city": "Zürich ☃"}'


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (HermesParser, f'<tool_call>{{"name": "f", "arguments": {DEEP}}}</tool_call>'),
        (HermesParser, f"<tool_call>{DEEP}</tool_call>"),
        (Llama3JsonParser, DEEP),
        (RequiredToolParser, DEEP),
        (PythonicParser, DEEP),
    ],
)
def test_output_nested_deeper_than_the_json_reader_goes_stays_content(make, text):
    # A model stuck repeating "[" must not fail its job: like any other output that is no call, it is content.
    content, _, calls = collect(make(), [text])
    assert (content, calls) == (text, [])
