"""Incremental text with stop strings: nothing of a stop string leaks, nothing is split or lost."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from chatq.core.settings import Settings
from chatq.worker.detokenize import TextStream


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


def test_a_stop_string_begun_before_min_tokens_ends_the_text_where_it_completes(tok):
    # "Hello wor" comes while min_tokens holds stops off, and "o world" completes once they count: the text ends
    # before it, as vLLM ends it, and no part of it was sent meanwhile.
    stream = TextStream(tok, ["o world"])
    ids = [tok.token_to_id(t) for t in ["Hello", "Ġwor", "ld", "!"]]
    pieces = [stream.add(ids[0], check_stops=False).text, stream.add(ids[1], check_stops=False).text]
    last = stream.add(ids[2])
    assert pieces == ["Hell", ""] and (last.text, last.stop) == ("", "o world")
    # A stop wholly inside the text sent before stops counted is not one.
    early = TextStream(tok, ["lo"])
    assert early.add(ids[0], check_stops=False).text == "Hello" and early.add(ids[1]).stop is None


def test_the_first_word_keeps_its_space_after_the_prompt():
    # A SentencePiece decoder drops the space before the first word of a text; after the prompt it is not first.
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    assert sp.decode([4, 5]) == "Paris."  # on its own, the space is gone
    stream = TextStream(sp, [], prompt_ids=[1, 2, 3])
    assert stream.add(4).text + stream.add(5).text == " Paris."


def test_a_prompt_that_ends_inside_a_character_leaves_only_the_rest_of_it_to_the_output(tok):
    # As a client continuing a text cut inside an emoji sends it: the prompt's last token holds part of its bytes.
    ids = tok.encode("Smile 😀 please", add_special_tokens=False).ids
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))
    stream = TextStream(tok, [], prompt_ids=ids[:cut])
    text = "".join(stream.add(t).text for t in ids[cut:])
    # The unfinished character comes whole, with the space its first token began with; no earlier prompt text.
    assert tok.decode(ids[:cut]) == "Smile \ufffd" and text == " 😀 please"
