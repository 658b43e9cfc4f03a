"""Prompt scoring through the whole stack: prompt logprobs, legacy echo with logprobs, `max_tokens: 0`, batches of
prompts, checked against transformers' log_softmax on the same weights."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.render import Renderer
from chatq.core.settings import Settings
from chatq.worker.model import load_model
from tests.helpers import assert_error, stream, wait_for

# lm-evaluation-harness's loglikelihood requests: a context and a continuation, scored as one prompt of token ids.
PAIRS = [
    ("Question: What is the capital of France?\nAnswer:", " Paris"),
    ("Question: What is the capital of France?\nAnswer:", " a small dog"),
    ("Two plus two equals", " four"),
]


@pytest.fixture(scope="module")
def model():
    return load_model(Settings(device="cpu"))


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: transformers' distribution before each token but the first, in float32."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)


def harness_requests(renderer: Renderer) -> tuple[list[list[int]], list[int]]:
    """The prompts (context then continuation, as ids) and each one's context length."""
    prompts, ctxlens = [], []
    for context, continuation in PAIRS:
        ctx = renderer.tokenizer.encode(context).ids
        prompts.append(ctx + renderer.tokenizer.encode(continuation).ids)
        ctxlens.append(len(ctx))
    return prompts, ctxlens


def harness_score(choice: dict, ctxlen: int, generated: int) -> tuple[float, bool]:
    """What lm-evaluation-harness reads from a choice: the continuation's summed logprob and whether it is greedy."""
    end = len(choice["logprobs"]["token_logprobs"]) - generated
    logprobs = choice["logprobs"]["token_logprobs"][ctxlen:end]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
    return sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))


def expected_score(model, ids: list[int], ctxlen: int) -> tuple[float, bool]:
    lp = log_softmax(model, ids)
    positions = range(ctxlen - 1, len(ids) - 1)
    total = sum(float(lp[p, ids[p + 1]]) for p in positions)
    return total, all(int(lp[p].argmax()) == ids[p + 1] for p in positions)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_requests_score_as_transformers(http: httpx.Client, model, renderer, max_tokens):
    prompts, ctxlens = harness_requests(renderer)
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0, "seed": 1234}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for choice, ids, ctxlen in zip(choices, prompts, ctxlens, strict=True):
        lps = choice["logprobs"]
        assert len(lps["tokens"]) == len(ids) + max_tokens
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        assert lps["text_offset"][0] == 0
        assert choice["text"].startswith(renderer.tokenizer.decode(ids, skip_special_tokens=False))
        score, greedy = harness_score(choice, ctxlen, max_tokens)
        want, want_greedy = expected_score(model, ids, ctxlen)
        assert score == pytest.approx(want, abs=1e-4 * len(ids))
        assert greedy == want_greedy
        # Every prompt token's logprob, not only the continuation's.
        lp = log_softmax(model, ids)
        assert lps["token_logprobs"][1 : len(ids)] == pytest.approx(
            [float(lp[p, ids[p + 1]]) for p in range(len(ids) - 1)], abs=1e-4
        )
    assert harness_score(choices[0], ctxlens[0], max_tokens)[0] > harness_score(choices[1], ctxlens[1], max_tokens)[0]
    if max_tokens == 0:
        assert all(c["text"] == renderer.tokenizer.decode(p) for c, p in zip(choices, prompts, strict=True))
        assert all(c["finish_reason"] in ("length", "stop") for c in choices)


def test_a_batch_streams_each_prompts_choices_by_index_as_its_whole_answer(http: httpx.Client):
    body = {"prompt": ["The sea is", "My cat likes"], "n": 2, "max_tokens": 5, "seed": 7, "echo": True, "logprobs": 2}
    body["ignore_eos"] = True
    whole = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert [c["text"][: len("The sea is")] for c in whole["choices"][:2]] == ["The sea is"] * 2
    assert all(c["text"].startswith("My cat likes") for c in whole["choices"][2:])
    assert whole["usage"]["completion_tokens"] == 20
    fs = stream(http, "POST", "/v1/completions", json={**body, "stream": True})
    streamed: dict[int, dict] = {}
    for f in fs[:-1]:
        for c in f.json["choices"]:
            got = streamed.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": []})
            got["text"] += c["text"]
            if c["logprobs"]:
                got["tokens"] += c["logprobs"]["tokens"]
                got["token_logprobs"] += c["logprobs"]["token_logprobs"]
    for c in whole["choices"]:
        got = streamed[c["index"]]
        assert got["text"] == c["text"]
        assert got["tokens"] == c["logprobs"]["tokens"]
        assert got["token_logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4)
    background = http.post("/v1/completions", json={**body, "background": True})
    assert background.status_code == 202
    done = wait_for(http, background.json()["id"], lambda j: j["status"] == "completed")
    assert [c["text"] for c in done["choices"]] == [c["text"] for c in whole["choices"]]
    assert done["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def check_prompt_logprobs(entries: list, ids: list[int], lp: torch.Tensor, k: int, renderer: Renderer) -> None:
    """vLLM's shape: null first, then the prompt token's entry (logprob, rank, text) and the k likeliest."""
    assert entries[0] is None and len(entries) == len(ids)
    for p, entry in enumerate(entries[1:]):
        token = ids[p + 1]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(float(lp[p, token]), abs=1e-4)
        assert mine["rank"] == int((lp[p] >= lp[p, token]).sum())
        assert mine["decoded_token"] == renderer.tokenizer.decode([token], skip_special_tokens=False)
        top = lp[p].topk(k).indices.tolist()
        assert set(entry) == {str(t) for t in [token, *top]}
        assert [entry[str(t)]["rank"] for t in top if t != token] == [r + 1 for r, t in enumerate(top) if t != token]
    assert next(iter(entries[1])) == str(ids[1])  # the prompt's token first


def test_prompt_logprobs_in_legacy_and_chat_equal_transformers(http: httpx.Client, model, renderer, model_name):
    prompt = "The quick brown fox jumps over the lazy dog."
    out = http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3, "n": 2, "seed": 1}
    )
    assert out.status_code == 200, out.text
    ids = renderer.tokenizer.encode(prompt).ids
    lp = log_softmax(model, ids)
    for choice in out.json()["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], ids, lp, 3, renderer)
        assert choice["logprobs"] is None
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 2})
    assert chat.status_code == 200, chat.text
    chat_ids = renderer.render(ChatCompletionRequest(messages=messages)).ids
    check_prompt_logprobs(chat.json()["prompt_logprobs"], chat_ids, log_softmax(model, chat_ids), 2, renderer)
    assert "prompt_logprobs" not in chat.json()["choices"][0]


def test_echo_logprobs_stream_as_whole(http: httpx.Client):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    fs = stream(http, "POST", "/v1/completions", json={**body, "stream": True, "prompt_logprobs": 0})
    chunks = [c for f in fs[:-1] for c in f.json["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[0]["text"] == "Once upon a time" and chunks[0]["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    assert all(top is None or len(top) == 1 for top in whole["logprobs"]["top_logprobs"])
    offsets = whole["logprobs"]["text_offset"]
    assert all(math.isfinite(o) for o in offsets) and offsets == sorted(offsets)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "not available when `stream=True`"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "greater than max allowed: 20"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "greater than max allowed: 20"),
        ({"prompt_logprobs": -2}, "prompt_logprobs", "positive value or -1"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"prompt": ["a"] * 1025}, "prompt", "maximum allowed count of 1024"),
        ({"prompt": ["a", ""]}, "prompt", "must not be empty"),
        ({"prompt": ["a"] * 512, "n": 3}, "n", "at most 1024 choices in all"),
    ],
)
def test_scoring_requests_vllm_refuses_are_refused(http: httpx.Client, body, param, words):
    error = assert_error(http.post("/v1/completions", json={"prompt": "Hi", **body}), 400, "BadRequestError", param)
    assert words in error["message"]
