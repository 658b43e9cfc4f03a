from __future__ import annotations

import pytest

from chatq.worker.parse.hermes import HermesParser


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


WEATHER = call("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = call("get_time", '{"tz": "Europe/Paris"}')
BAD = '<tool_call>{"name": "f", "arguments": {"a": }</tool_call>'

# (text, content, calls)
CASES = [
    ("Hello there.", "Hello there.", []),
    ("", "", []),
    ("  \n", "  \n", []),
    (WEATHER, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("\n" + WEATHER + "\n", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (
        "Let me check.\n" + WEATHER,
        "Let me check.\n",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    (
        WEATHER + "\n" + TIME + "\n",
        None,
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (WEATHER + "\nDone.", "\nDone.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # Generation ended before </tool_call>: still a call when its JSON is complete.
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n', None, [("f", {"x": 1})]),
    (
        TIME + '\n<tool_call>{"name": "f", "arguments": {}}',
        None,
        [("get_time", {"tz": "Europe/Paris"}), ("f", {})],
    ),
    # Invalid or incomplete JSON: no call, the raw text stays content.
    (BAD, BAD, []),
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
    ("<tool_call> is how I call tools", "<tool_call> is how I call tools", []),
    ('<tool_call>["f", {}]</tool_call>', '<tool_call>["f", {}]</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (WEATHER + "\n" + BAD, "\n" + BAD, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # Arguments are re-serialized canonically, unicode unescaped.
    (
        call("f", '{"city":"Z\\u00fcrich","note":"日本 🌧"}'),
        None,
        [("f", {"city": "Zürich", "note": "日本 🌧"})],
    ),
    (call("f", '{"a":1,"b":[1,2,{"c":null}]}'), None, [("f", {"a": 1, "b": [1, 2, {"c": None}]})]),
    (call("f", "{}"), None, [("f", {})]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    (call("f", '"{\\"a\\": 1}"'), None, [("f", {"a": 1})]),  # arguments sent as a JSON string
    ('<tool_call>{"name": "f", "parameters": {"a": true}}</tool_call>', None, [("f", {"a": True})]),
    # Look-alikes and partial tags stay content.
    ("Use <tool_", "Use <tool_", []),
    ("a <tool> b </tool_call> c", "a <tool> b </tool_call> c", []),
    ("<tool_cal", "<tool_cal", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_hermes(check, text, content, calls):
    check(HermesParser, text, content, None, calls)


def test_unknown_tool_name_stays_content(check):
    text = call("rm_rf", "{}")
    check(lambda: HermesParser({"get_weather"}), text, text)
    check(lambda: HermesParser({"rm_rf"}), text, None, None, [("rm_rf", {})])


def test_id_and_name_only_on_first_delta():
    parser = HermesParser()
    deltas = [parser.feed(c) for c in WEATHER + TIME]
    deltas.append(parser.finish())
    calls = [c for d in deltas for c in d.tool_calls]
    assert [c.index for c in calls if c.id] == [0, 1]
    assert [c.name for c in calls if c.name] == ["get_weather", "get_time"]
    assert len({c.id for c in calls if c.id}) == 2
