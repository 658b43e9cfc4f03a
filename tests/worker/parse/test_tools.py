from __future__ import annotations

import re
from typing import get_args

import pytest
from pydantic import ValidationError

from chatq.core.settings import Settings
from chatq.worker.parse import ContentParser
from chatq.worker.parse.common import new_call_id
from chatq.worker.parse.tools import TOOL_PARSERS
from tests.helpers import collect

OUTPUTS = {
    "hermes": '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    "llama3_json": '{"name": "f", "parameters": {"a": 1}}',
    "pythonic": "[f(a=1)]",
}


def test_the_setting_names_exactly_the_registered_parsers():
    assert set(get_args(Settings.model_fields["tool_parser"].annotation)) == {"", *TOOL_PARSERS}
    with pytest.raises(ValidationError, match="tool_parser"):
        Settings(tool_parser="hermess")
    with pytest.raises(ValidationError, match="reasoning_parser"):
        Settings(reasoning_parser="qwen")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "pythonic"])
def test_registry(name):
    content, reasoning, calls = collect(TOOL_PARSERS[name](tool_names={"f"}), [OUTPUTS[name]])
    assert content is None and reasoning is None
    assert calls == [{"id": calls[0]["id"], "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]


def test_call_ids_are_unique():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)


def test_collect_plain_content():
    assert collect(ContentParser(), ["Hel", "lo"]) == ("Hello", None, [])
    assert collect(ContentParser(), []) == ("", None, [])
