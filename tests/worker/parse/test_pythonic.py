from __future__ import annotations

import pytest

from chatq.worker.parse.pythonic import PythonicParser

# (text, content, calls)
CASES = [
    ("Paris is sunny.", "Paris is sunny.", []),
    ('[get_weather(city="Paris")]', None, [("get_weather", {"city": "Paris"})]),
    ('\n [get_weather(city="Paris")]\n', None, [("get_weather", {"city": "Paris"})]),
    ("[ping()]", None, [("ping", {})]),
    (
        "[get_weather(city='Paris', days=3), search(q=\"x\", limit=10, ratio=-0.5, tags=['a', 'b'],"
        " opts={'deep': True, 'n': None}, pair=(1, 2), off=False)]",
        None,
        [
            ("get_weather", {"city": "Paris", "days": 3}),
            (
                "search",
                {
                    "q": "x",
                    "limit": 10,
                    "ratio": -0.5,
                    "tags": ["a", "b"],
                    "opts": {"deep": True, "n": None},
                    "pair": [1, 2],
                    "off": False,
                },
            ),
        ],
    ),
    ('[f(s="Zürich 日本 🌧", e="\\u00e9")]', None, [("f", {"s": "Zürich 日本 🌧", "e": "é"})]),
    # Looks like a call but is not a whole list of literal keyword calls: content.
    ('get_weather(city="Paris")', 'get_weather(city="Paris")', []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ("[f(x)]", "[f(x)]", []),
    ("[f(x=y)]", "[f(x=y)]", []),
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[os.system(cmd='ls')]", "[os.system(cmd='ls')]", []),
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),
    ("[f(x=1", "[f(x=1", []),
    # Output that stops being calls after a call is content from there on; a call cut short stays as far as written.
    ("[f(x=1)] and then", " and then", [("f", {"x": 1})]),
    ("[f(x=1), 2]", ", 2]", [("f", {"x": 1})]),
    ("[f(x=1), g(y=", ", g(y=", [("f", {"x": 1})]),
    ('[f(x=1, s="a, (b)"), g(y=[1, 2], z=', None, [("f", {"x": 1, "s": "a, (b)"}), ("g", '{"y": [1, 2]')]),
    ("[f(x=1, x=2)]", None, [("f", '{"x": 1')]),
    ("[link](http://x)", "[link](http://x)", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_pythonic(check, text, content, calls):
    check(PythonicParser, text, content, None, calls)


def test_unknown_tool_name_stays_content(check):
    check(lambda: PythonicParser({"search"}), "[f(x=1)]", "[f(x=1)]")
    check(lambda: PythonicParser({"f"}), "[f(x=1)]", None, None, [("f", {"x": 1})])


def test_a_call_streams_an_argument_at_a_time():
    text = '[get_weather(city="Paris", days=3)]'
    parser = PythonicParser({"get_weather"})
    deltas = [parser.feed(c) for c in text]
    calls = [(i, c) for i, d in enumerate(deltas) for c in d.tool_calls]
    assert [(text[: i + 1][-2:], c.name, c.arguments) for i, c in calls] == [
        ('",', "get_weather", ""),
        ('",', None, '{"city": "Paris"'),
        ("3)", None, ', "days": 3'),
        ("3)", None, "}"),
    ]
    assert not parser.finish()
