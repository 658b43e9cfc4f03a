from __future__ import annotations

import pytest

from chatq.worker.parse.llama3_json import Llama3JsonParser

WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'

# (text, content, calls)
CASES = [
    ("The answer is 4.", "The answer is 4.", []),
    ("", "", []),
    (WEATHER, None, [("get_weather", {"city": "Paris"})]),
    ("\n  " + WEATHER + "\n", None, [("get_weather", {"city": "Paris"})]),
    ("<|python_tag|>" + WEATHER, None, [("get_weather", {"city": "Paris"})]),
    ("<|python_tag|>\n" + TIME, None, [("get_time", {"tz": "UTC"})]),
    (WEATHER + "; " + TIME, None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    (WEATHER + ";" + TIME + ";", None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    ('{"name": "f", "parameters": {}}', None, [("f", {})]),
    (
        '{"name":"f","parameters":{"s":"日本 \\u00e9","n":[1,2.5,null]}}',
        None,
        [("f", {"s": "日本 é", "n": [1, 2.5, None]})],
    ),
    # JSON that is not calls is content.
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ('{"name": "f", "parameters": "x"}', '{"name": "f", "parameters": "x"}', []),
    # Output that stops being calls is content from there on.
    (WEATHER + " is how I would call it", " is how I would call it", [("get_weather", {"city": "Paris"})]),
    (WEATHER + " " + TIME, " " + TIME, [("get_weather", {"city": "Paris"})]),
    (WEATHER + '; {"answer": 42}', '; {"answer": 42}', [("get_weather", {"city": "Paris"})]),
    # A call whose arguments had begun streams: cut short or gone wrong, they stay as far as they were written.
    ('{"name": "f", "parameters": {', None, [("f", "{")]),
    ('{"name": "f", "parameters": {"a": tru', None, [("f", '{"a": ')]),
    (
        WEATHER + '; {"name": "f", "parameters": {"a": ]} and more',
        None,
        [("get_weather", {"city": "Paris"}), ("f", '{"a": ')],
    ),
    # Arguments as a JSON string: read whole.
    ('{"name": "f", "parameters": "{\\"a\\": 1}"}', None, [("f", {"a": 1})]),
    ('[{"name": "f", "parameters": {}}]', '[{"name": "f", "parameters": {}}]', []),
    ("Call " + WEATHER, "Call " + WEATHER, []),
    ("<|python_stuff|>", "<|python_stuff|>", []),
    ("<|python_tag|>", "<|python_tag|>", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_llama3_json(check, text, content, calls):
    check(Llama3JsonParser, text, content, None, calls)


def test_unknown_tool_name_stays_content(check):
    check(lambda: Llama3JsonParser({"search"}), WEATHER, WEATHER)


def test_plain_text_streams_at_once():
    parser = Llama3JsonParser()
    assert parser.feed("Hel").content == "Hel"
    assert parser.feed("lo").content == "lo"


def test_a_call_streams_once_it_is_sure():
    parser = Llama3JsonParser({"get_weather"})
    deltas = [parser.feed(c) for c in WEATHER]
    head_at = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert WEATHER[: head_at + 1].endswith('"parameters": {')
    assert not any(d.content for d in deltas)
    fragments = [c.arguments for d in deltas for c in d.tool_calls]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris"}'
