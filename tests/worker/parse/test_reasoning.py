from __future__ import annotations

import pytest

from chatq.worker.parse import ContentParser
from chatq.worker.parse.hermes import HermesParser
from chatq.worker.parse.reasoning import ReasoningParser

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'

# (text, content, reasoning)
CASES = [
    ("<think>I think</think>Answer", "Answer", "I think"),
    # qwen3's layout: the blank line after the end tag is content, as vLLM splits it.
    ("<think>\nLet me see.\n</think>\n\nParis.", "\n\nParis.", "\nLet me see.\n"),
    ("Hmm, 2+2.\n</think>\n\n4", "\n\n4", "Hmm, 2+2.\n"),  # deepseek_r1: start tag was in the prompt
    ("\n<think>a</think>b", "b", "a"),
    ("<think>still thinking", "", "still thinking"),  # no end tag: all reasoning
    ("just thinking, no tags", "", "just thinking, no tags"),
    ("<think></think>Hi", "Hi", None),
    ("<think>x</think>\n\n", "\n\n", "x"),
    ("", "", None),
    # Partial or look-alike tags are reasoning text, never dropped or leaked into content.
    ("a </thi b</think>c", "c", "a </thi b"),
    ("abc</thi", "", "abc</thi"),
    ("<thi", "", "<thi"),
    ("<thinking>x</think>y", "y", "<thinking>x"),
    ("<b>bold</b></think>x", "x", "<b>bold</b>"),
    ("a<think>b</think>c", "c", "a<think>b"),
    ("<think>a</think>b</think>c", "b</think>c", "a"),
]


@pytest.mark.parametrize("text,content,reasoning", CASES)
def test_reasoning(check, text, content, reasoning):
    check(lambda: ReasoningParser(ContentParser()), text, content, reasoning)


@pytest.mark.parametrize("text", ["Hello <think>x</think> there", "</think>Hi", "plain", "  \n"])
def test_thinking_disabled_is_all_content(check, text):
    check(lambda: ReasoningParser(ContentParser(), thinking_enabled=False), text, text)


def test_custom_tags(check):
    make = lambda: ReasoningParser(ContentParser(), start="<seed:think>", end="</seed:think>")  # noqa: E731
    check(make, "<seed:think>hm</seed:think>ok", "ok", "hm")


def test_reasoning_then_tool_call(check):
    make = lambda: ReasoningParser(HermesParser())  # noqa: E731
    check(
        make,
        f"<think>I need the weather.</think>\n\n{CALL}",
        None,
        "I need the weather.",
        [("get_weather", {"city": "Paris"})],
    )


def test_tool_call_inside_thought_is_reasoning(check):
    make = lambda: ReasoningParser(HermesParser())  # noqa: E731
    check(make, f"<think>maybe {CALL}</think>No call.", "No call.", f"maybe {CALL}")
    check(make, f"<think>maybe {CALL}", "", f"maybe {CALL}")


def test_thinking_disabled_tool_call(check):
    make = lambda: ReasoningParser(HermesParser(), thinking_enabled=False)  # noqa: E731
    check(make, CALL, None, None, [("get_weather", {"city": "Paris"})])
