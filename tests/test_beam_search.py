"""Beam search and best_of through the whole stack: beams equal to transformers' generate(num_beams=...) on the same
weights, whole, streamed and in the background; best_of's answer the best of its candidates by cumulative logprob."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from chatq.core.settings import Settings
from chatq.worker.model import load_model
from tests.helpers import frames, model_info

COLOUR = [{"role": "user", "content": "Name a colour and say why you like it."}]
START = "The lighthouse keeper opened the door and"


@pytest.fixture(scope="module")
def model():
    return load_model(Settings(device="cpu"))


def prompt_ids(http: httpx.Client, **body) -> list[int]:
    resp = http.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def transformers_texts(model, renderer, ids, width, new, **kw) -> tuple[list[str], int]:
    """transformers' beams as text, and how many tokens they hold."""
    eos = sorted(model_info().eos_token_ids)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            repetition_penalty=1.0,  # plain beam search, whatever the model's generation config holds
            max_new_tokens=new,
            eos_token_id=eos,
            pad_token_id=-1,
            **kw,
        )
    beams = [[t for t in row[len(ids) :].tolist() if t != -1] for row in out]
    texts = [renderer.tokenizer.decode(b, skip_special_tokens=True) for b in beams]
    return texts, sum(len(b) for b in beams)


def streamed(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        return [f.json for f in frames(resp.iter_lines()) if f.data != "[DONE]"]


def test_chat_beams_equal_transformers_whole_and_streamed(http, model, renderer, model_name):
    body = {"model": model_name, "messages": COLOUR, "n": 3, "use_beam_search": True, "max_tokens": 24}
    expected, tokens = transformers_texts(model, renderer, prompt_ids(http, messages=COLOUR), 3, 24)
    whole = http.post("/v1/chat/completions", json=body).json()
    assert [c["message"]["content"] for c in whole["choices"]] == expected
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == tokens
    chunks = streamed(http, "/v1/chat/completions", body)
    # As vLLM streams a beam search: each choice's answer in one delta, once the search is over.
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"] and c["choices"][0]["delta"]]
    contents = {}
    for c in chunks:
        for choice in c["choices"]:
            if choice["delta"].get("content"):
                assert choice["index"] not in contents, "one delta per choice"
                contents[choice["index"]] = choice["delta"]["content"]
    assert [contents[i] for i in range(3)] == expected, texts
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [c["finish_reason"] for c in whole["choices"]]


def test_completion_beams_with_length_penalty_and_early_stopping_equal_transformers(http, model, renderer, model_name):
    body = {
        "model": model_name,
        "prompt": START,
        "n": 2,
        "use_beam_search": True,
        "length_penalty": 0.5,
        "early_stopping": True,
        "max_tokens": 20,
    }
    ids = prompt_ids(http, prompt=START)
    expected, tokens = transformers_texts(model, renderer, ids, 2, 20, length_penalty=0.5, early_stopping=True)
    whole = http.post("/v1/completions", json=body).json()
    assert [c["text"] for c in whole["choices"]] == expected
    assert whole["usage"]["completion_tokens"] == tokens
    chunks = streamed(http, "/v1/completions", body)
    texts = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in chunks if c["choices"][0]["text"]}
    assert [texts[i] for i in range(2)] == expected


def test_a_background_beam_search_answers_as_the_waited_one(http, model_name):
    body = {"model": model_name, "messages": COLOUR, "n": 2, "use_beam_search": True, "max_tokens": 16}
    waited = http.post("/v1/chat/completions", json=body).json()
    queued = http.post("/v1/chat/completions", json={**body, "background": True})
    assert queued.status_code == 202, queued.text
    job_id = queued.json()["id"]
    for _ in range(600):
        job = http.get(f"/v1/chat/completions/{job_id}").json()
        if job["status"] == "completed":
            break
        assert job["status"] in ("queued", "in_progress"), job

        time.sleep(0.1)
    assert [c["message"] for c in job["choices"]] == [c["message"] for c in waited["choices"]]


def test_best_of_answers_the_candidate_with_the_highest_cumulative_logprob(client: openai.OpenAI, model_name):
    """Candidates are sampled with seeds seed, seed+1, ...: the same as the choices of n=best_of with that seed."""
    common = dict(model=model_name, messages=COLOUR, max_tokens=12, temperature=1.0, seed=7, logprobs=True)
    candidates = client.chat.completions.create(n=3, **common)
    scores = [sum(t.logprob for t in c.logprobs.content) for c in candidates.choices]
    ranked = [candidates.choices[i].message.content for i in sorted(range(3), key=lambda i: -scores[i])]
    best = client.chat.completions.create(n=2, extra_body={"best_of": 3}, **common)
    assert [c.message.content for c in best.choices] == ranked[:2]
    assert [c.index for c in best.choices] == [0, 1]
    # Usage counts what was generated: every candidate.
    assert best.usage.completion_tokens == candidates.usage.completion_tokens
    stream = client.chat.completions.create(n=2, stream=True, extra_body={"best_of": 3}, **common)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[0], texts[1]] == ranked[:2]


def test_best_of_in_legacy_completions(client: openai.OpenAI, model_name):
    common = dict(model=model_name, prompt=START, max_tokens=10, temperature=1.0, seed=3, logprobs=0)
    candidates = client.completions.create(n=4, **common)
    scores = [sum(c.logprobs.token_logprobs) for c in candidates.choices]
    best = max(range(4), key=lambda i: scores[i])
    answer = client.completions.create(best_of=4, **common)
    assert [c.text for c in answer.choices] == [candidates.choices[best].text]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True, "n": 2, "stop": ["."]}, "stop"),
        ({"use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "n": 2, "logprobs": True}, "logprobs"),
        ({"use_beam_search": True, "n": 2, "best_of": 3}, "best_of"),
        ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "temperature": 0}, "best_of"),
    ],
)
def test_what_beam_search_and_best_of_cannot_honour_is_refused_by_name(http, model_name, fields, param):
    resp = http.post("/v1/chat/completions", json={"model": model_name, "messages": COLOUR, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_each_prompt_of_a_list_gets_its_own_beams_and_best_of(http, model, renderer, model_name):
    prompts = [START, "Once upon a time"]
    body = {"model": model_name, "prompt": prompts, "n": 2, "use_beam_search": True, "max_tokens": 12}
    expected = []
    for prompt in prompts:
        expected += transformers_texts(model, renderer, prompt_ids(http, prompt=prompt), 2, 12)[0]
    whole = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    assert [c["text"] for c in whole["choices"]] == expected
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in whole["choices"][1:3]] == [
        prompt_ids(http, prompt=START),
        prompt_ids(http, prompt=prompts[1]),
    ]
    assert [renderer.tokenizer.decode(c["token_ids"]) for c in whole["choices"]] == expected
    # best_of ranks each prompt's candidates among themselves.
    sampled = {"model": model_name, "prompt": prompts, "max_tokens": 8, "temperature": 1.0, "seed": 5, "logprobs": 0}
    candidates = http.post("/v1/completions", json={**sampled, "n": 3}).json()["choices"]
    best = http.post("/v1/completions", json={**sampled, "best_of": 3}).json()["choices"]
    for p in range(2):
        mine = candidates[3 * p : 3 * p + 3]
        top = max(mine, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
        assert (best[p]["index"], best[p]["text"]) == (p, top["text"])
