"""Run a parser over a text whole and at many chunkings: every result must equal the expected one."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from chatq.core.delta import Delta
from chatq.worker.parse import Parser
from tests.helpers import collect, combine

CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def chunkings(text: str) -> Iterator[list[str]]:
    # Every fixed piece size 1-8, every single split point (a tag cut anywhere), and some mixed sizes.
    for size in range(1, 9):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(text)
    for _ in range(20):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 8)
            pieces.append(text[i : i + n])
            i += n
        yield pieces


def check_call_deltas(deltas: list[Delta]) -> None:
    """A call's id and name come exactly once, on its first delta."""
    seen: set[int] = set()
    for d in deltas:
        for c in d.tool_calls:
            if c.index in seen:
                assert c.id is None and c.name is None
            else:
                assert c.id is not None and CALL_ID.fullmatch(c.id) and c.name
                seen.add(c.index)
    assert seen == set(range(len(seen)))  # indexes count up from 0


def simple(message: tuple[str | None, str | None, list[dict[str, Any]]]) -> tuple[Any, ...]:
    """The message without its random call ids."""
    content, reasoning, calls = message
    for c in calls:
        assert CALL_ID.fullmatch(c["id"]) and c["type"] == "function"
    return content, reasoning, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


Check = Callable[..., None]


@pytest.fixture
def check() -> Check:
    def run(
        make: Callable[[], Parser],
        text: str,
        content: str | None,
        reasoning: str | None = None,
        calls: list[tuple[str, dict[str, Any] | str]] | None = None,
    ) -> None:
        # Arguments must be exactly the canonical serialization: what the non-streamed message carries. A string is
        # arguments that went wrong once the call was streaming, as far as they were written.
        expected_calls = [
            (name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
            for name, args in calls or []
        ]
        expected = (content, reasoning, expected_calls)
        assert simple(collect(make(), [text])) == expected
        for pieces in chunkings(text):
            parser = make()
            deltas = [parser.feed(p) for p in pieces]
            deltas.append(parser.finish())
            check_call_deltas(deltas)
            assert simple(combine(deltas)) == expected, pieces

    return run
