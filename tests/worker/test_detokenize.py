"""Incremental text with stop strings: nothing of a stop string leaks, nothing is split or lost."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from shared.settings import Settings
from worker.detokenize import TextStream


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(Settings().model_dir / "tokenizer.json"))


def feed(stream: TextStream, ids: list[int]) -> tuple[list[str], str | None]:
    pieces = []
    for i in ids:
        piece = stream.add(i)
        pieces.append(piece.text)
        if piece.stop:
            return pieces, piece.stop
    pieces.append(stream.flush())
    return pieces, None


TEXT = "Hello wörld 😀, the end is near. STOP here and more"


def test_pieces_join_to_the_decoded_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    pieces, stop = feed(TextStream(tok, []), ids)
    assert "".join(pieces) == TEXT and stop is None
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(
    ("stops", "expected", "matched"),
    [
        (["STOP"], "Hello wörld 😀, the end is near. ", "STOP"),
        (["near. ST", "zzz"], "Hello wörld 😀, the end is ", "near. ST"),
        (["😀"], "Hello wörld ", "😀"),
        (["absent"], TEXT, None),
        (["more", "end"], "Hello wörld 😀, the ", "end"),
    ],
)
def test_stop_strings_are_cut_and_never_leak(tok, stops, expected, matched):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    stream = TextStream(tok, stops)
    pieces, stop = feed(stream, ids)
    assert "".join(pieces) == expected and stop == matched
    emitted = ""
    for p in pieces:
        emitted += p
        assert not any(s in emitted for s in stops)


def test_include_stop_keeps_the_stop_string(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    pieces, stop = feed(TextStream(tok, ["STOP"], include_stop=True), ids)
    assert "".join(pieces) == "Hello wörld 😀, the end is near. STOP"
