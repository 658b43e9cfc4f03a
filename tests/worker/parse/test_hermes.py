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
    # A call whose arguments had begun streams: arguments that go wrong stay as far as they were written, and the
    # rest of the call's text is dropped.
    (BAD, None, [("f", '{"a": ')]),
    ('<tool_call>{"name": "f", "arguments": {"q": "Par', None, [("f", '{"q": "Par')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}}} junk</tool_call>ok', "ok", [("f", {"a": 1})]),
    # Invalid or incomplete JSON before the arguments began: no call, the raw text stays content.
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
    (
        '<tool_call>{"name": "f" "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f" "arguments": {}}</tool_call>',
        [],
    ),
    ("<tool_call> is how I call tools", "<tool_call> is how I call tools", []),
    ('<tool_call>["f", {}]</tool_call>', '<tool_call>["f", {}]</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (WEATHER + "\n" + BAD, None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("f", '{"a": ')]),
    # Arguments before the name: the call streams once its name is written.
    ('<tool_call>{"arguments": {"a": [1]}, "name": "f"}</tool_call>', None, [("f", {"a": [1]})]),
    # Arguments are re-serialized canonically, unicode unescaped.
    (
        call("f", '{"city":"Z\\u00fcrich","note":"日本 🌧"}'),
        None,
        [("f", {"city": "Zürich", "note": "日本 🌧"})],
    ),
    (call("f", '{"a":1,"b":[1,2,{"c":null}]}'), None, [("f", {"a": 1, "b": [1, 2, {"c": None}]})]),
    (call("f", "{}"), None, [("f", {})]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    (call("f", '"{\\"a\\": 1}"'), None, [("f", {"a": 1})]),  # arguments sent as a JSON string: read whole
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


def test_a_call_streams_its_name_then_its_arguments_as_they_are_written():
    parser = HermesParser({"get_weather"})
    text = "Sure." + WEATHER
    deltas = [parser.feed(c) for c in text]
    head_at = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert text[: head_at + 1].endswith('"arguments": {')  # the name is out before any argument is written
    head = deltas[head_at].tool_calls[0]
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "")
    fragments = [c.arguments for d in deltas for c in d.tool_calls if c.id is None]
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "Paris", "unit": "celsius"}'
    assert not parser.finish()


def test_an_unknown_name_is_not_streamed():
    parser = HermesParser({"get_weather"})
    deltas = [parser.feed(c) for c in TIME[:-1]]
    assert not any(d.tool_calls for d in deltas)
