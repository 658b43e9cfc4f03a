"""vLLM's token filters and token ids on the real stack: allowed_token_ids, bad_words, repetition_detection,
logprob_token_ids, return_token_ids and return_tokens_as_token_ids, in chat and legacy completions, streamed and
whole, for n > 1 and in background jobs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.render import Renderer, bad_words_ids
from chatq.worker.engine import repeats
from tests.helpers import assert_error, stream, wait_for

COUNT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def post(http: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = http.post(url, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def chunks_of(http: httpx.Client, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return [f.json for f in stream(http, "POST", url, json={**body, "stream": True}) if f.data != "[DONE]"]


def streamed_ids(chunks: list[dict[str, Any]], index: int) -> list[int]:
    """A choice's token ids as its chunks carried them."""
    return [t for c in chunks for ch in c["choices"] if ch["index"] == index for t in ch.get("token_ids") or []]


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def test_allowed_token_ids_alone_are_sampled_and_every_id_is_returned(http, renderer: Renderer):
    allowed = sorted({t for w in (" 1", " 2", " 3", ",", "1", "2", "3") for t in renderer.tokenizer.encode(w).ids})
    body = {"messages": COUNT, "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 12, "ignore_eos": True}
    body |= {"allowed_token_ids": allowed, "return_token_ids": True}
    whole = post(http, CHAT, body)
    assert whole["prompt_token_ids"] == renderer.render(ChatCompletionRequest(messages=COUNT)).ids
    for choice in whole["choices"]:
        assert len(choice["token_ids"]) == 12 and set(choice["token_ids"]) <= set(allowed)
        assert renderer.tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    chunks = chunks_of(http, CHAT, body)
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [whole["prompt_token_ids"]] * 2
    assert [streamed_ids(chunks, i) for i in (0, 1)] == [c["token_ids"] for c in whole["choices"]]
    # The logprobs stay the model's, taken before the filter, as vLLM takes them.
    free = post(http, CHAT, {"messages": COUNT, "temperature": 0, "max_tokens": 1, "logprobs": True})
    held = post(http, CHAT, {**body, "n": 1, "temperature": 0, "max_tokens": 1, "logprobs": True, "top_logprobs": 1})
    first = held["choices"][0]["logprobs"]["content"][0]
    assert first["top_logprobs"][0]["token"] == free["choices"][0]["logprobs"]["content"][0]["token"]


def test_legacy_completions_return_prompt_and_choice_ids_in_each_choice(http, renderer: Renderer):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = post(http, TEXT, body)
    prompt = renderer.tokenizer.encode("The capital of France is").ids
    (choice,) = whole["choices"]
    assert choice["prompt_token_ids"] == prompt and "prompt_token_ids" not in whole
    assert renderer.tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = chunks_of(http, TEXT, body)
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c["choices"][0]] == [prompt]
    assert streamed_ids(chunks, 0) == choice["token_ids"]


def test_bad_words_block_a_words_last_token_only_after_its_prefix(http, renderer: Renderer):
    # The model counts "1. 1\n2. 2\n3. 3\n...": "3. 3" is banned, "3." alone is not.
    banned = bad_words_ids(renderer.tokenizer, ["3. 3"])
    chat = {"messages": COUNT, "temperature": 0, "max_tokens": 18, "return_token_ids": True}
    text = {"prompt": "1. 1\n2. 2\n", "temperature": 0, "max_tokens": 8, "return_token_ids": True}
    for url, req in ((CHAT, chat), (TEXT, text)):
        free = post(http, url, req)["choices"][0]
        assert any(contains(free["token_ids"], w) for w in banned), free
        held = post(http, url, {**req, "bad_words": ["3. 3"]})["choices"][0]
        assert not any(contains(held["token_ids"], w) for w in banned), held
        said = held["message"]["content"] if url == CHAT else held["text"]
        assert "3." in said and "3. 3" not in said, said
        assert streamed_ids(chunks_of(http, url, {**req, "bad_words": ["3. 3"]}), 0) == held["token_ids"]


def test_a_word_that_makes_no_token_is_refused(http):
    resp = http.post(CHAT, json={"messages": COUNT, "bad_words": ["   "]})
    assert_error(resp, 400, BAD, "bad_words")


def test_repetition_detection_ends_the_output_at_the_first_repeat(http):
    body: dict[str, Any] = {"prompt": "hello hello hello hello hello", "temperature": 0, "max_tokens": 30}
    body |= {"ignore_eos": True, "return_token_ids": True}
    free = post(http, TEXT, body)["choices"][0]
    assert free["finish_reason"] == "length"
    # The greedy output opens with a blank line, two newline tokens: a pattern of one token, twice.
    detect = {**body, "repetition_detection": {"max_pattern_size": 2, "min_count": 2}}
    choice = post(http, TEXT, detect)["choices"][0]
    ids = choice["token_ids"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("repetition", "repetition_detected")
    assert repeats(ids, 1, 2, 2) and not any(repeats(ids[:k], 1, 2, 2) for k in range(len(ids)))
    assert ids == free["token_ids"][: len(ids)] and len(ids) < 30
    chunks = chunks_of(http, TEXT, detect)
    last = chunks[-1]["choices"][0]
    assert streamed_ids(chunks, 0) == ids
    assert (last["finish_reason"], last["stop_reason"]) == ("repetition", "repetition_detected")
    # Off at max_pattern_size 0, as when left out.
    off = post(http, TEXT, {**body, "repetition_detection": {"max_pattern_size": 0}})["choices"][0]
    assert (off["token_ids"], off["finish_reason"]) == (free["token_ids"], "length")


def test_logprob_token_ids_give_the_sampled_token_then_the_named_ones(http, renderer: Renderer):
    ask = {"messages": COUNT, "temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 5}
    top = post(http, CHAT, ask)["choices"][0]["logprobs"]["content"]
    named = [renderer.tokenizer.token_to_id(e["token"]) for e in top[0]["top_logprobs"][1:4]]
    named = [t for t in named if t is not None][:2] + [0]
    body = {**ask, "logprob_token_ids": named, "return_token_ids": True}
    whole = post(http, CHAT, body)["choices"][0]
    for i, (entry, sampled) in enumerate(zip(whole["logprobs"]["content"], whole["token_ids"], strict=True)):
        listed = [e["token"] for e in entry["top_logprobs"]]
        expected = [renderer.tokenizer.decode([t], skip_special_tokens=False) for t in [sampled, *named]]
        expected = list(dict.fromkeys(expected))
        assert listed == expected, (i, listed)
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    first = {e["token"]: e["logprob"] for e in top[0]["top_logprobs"]}
    for e in whole["logprobs"]["content"][0]["top_logprobs"]:
        if e["token"] in first:
            assert e["logprob"] == pytest.approx(first[e["token"]], abs=1e-5)
    chunks = chunks_of(http, CHAT, body)
    streamed = [e for c in chunks for e in (c["choices"][0].get("logprobs") or {}).get("content") or []]
    assert streamed == whole["logprobs"]["content"]
    # Legacy: `logprobs` set, and each position's top_logprobs holds the sampled token and the named ones.
    text = post(
        http,
        TEXT,
        {"prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0, "logprobs": 0} | {"logprob_token_ids": [0]},
    )
    for token, tops in zip(
        text["choices"][0]["logprobs"]["tokens"], text["choices"][0]["logprobs"]["top_logprobs"], strict=True
    ):
        assert list(tops) == [token, renderer.tokenizer.decode([0], skip_special_tokens=False)]


def test_return_tokens_as_token_ids_names_tokens_by_id(http):
    body = {"messages": COUNT, "temperature": 0, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    body |= {"return_tokens_as_token_ids": True, "return_token_ids": True}
    whole = post(http, CHAT, body)["choices"][0]
    entries = whole["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in whole["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
    # The sampled token's bytes stay its text's, as vLLM writes them.
    assert bytes(b for e in entries for b in e["bytes"]).decode() == whole["message"]["content"]
    legacy = {"prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0, "logprobs": 1}
    legacy |= {"return_tokens_as_token_ids": True, "return_token_ids": True}
    text = post(http, TEXT, legacy)
    lp = text["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in text["choices"][0]["token_ids"]]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)


def test_filters_hold_in_a_background_job(http, renderer: Renderer):
    allowed = sorted({t for w in (" yes", " no", "yes", "no") for t in renderer.tokenizer.encode(w).ids})
    body = {"messages": COUNT, "temperature": 0, "max_tokens": 6, "ignore_eos": True, "background": True}
    body |= {"allowed_token_ids": allowed, "return_token_ids": True}
    resp = http.post(CHAT, json=body)
    assert resp.status_code == 202, resp.text
    job = resp.json()
    done = wait_for(http, job["id"], lambda j: j["status"] == "completed")
    assert set(done["choices"][0]["token_ids"]) <= set(allowed) and len(done["choices"][0]["token_ids"]) == 6


M = [{"role": "user", "content": "hi"}]
BAD = "BadRequestError"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, 99999999]}, "allowed_token_ids"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"logprobs": True, "logprob_token_ids": [99999999]}, "logprob_token_ids"),
        ({"logprobs": True, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"repetition_detection": {"max_pattern_size": 2, "min_count": 1}}, "repetition_detection"),
        (
            {"repetition_detection": {"max_pattern_size": 1, "min_pattern_size": 2, "min_count": 2}},
            "repetition_detection",
        ),
        ({"max_repetition_pattern_size": 4}, "max_repetition_pattern_size"),
        ({"min_repetition_pattern_size": 1}, "min_repetition_pattern_size"),
        ({"repetition_min_count": 3}, "repetition_min_count"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ],
)
def test_token_filter_errors_name_the_field(http, extra, param):
    assert_error(http.post(CHAT, json={"messages": M, **extra}), 400, BAD, param)
