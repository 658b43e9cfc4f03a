"""The request fields and response shapes of the chat contract, seen through the official openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from chatq.core import keys
from tests.helpers import stream

COUNT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
STORY = [{"role": "user", "content": "Tell me a story about a brave knight."}]


def create(client: openai.OpenAI, model: str, **kw):
    return client.chat.completions.create(model=model, **kw)


def streamed(client: openai.OpenAI, model: str, **kw) -> list:
    return list(client.chat.completions.create(model=model, stream=True, **kw))


def text_of(chunks: list, index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def test_n_choices_sampled_independently_streamed_and_not(client, model_name):
    kw = dict(messages=STORY, n=3, temperature=1.0, seed=42, max_tokens=12, extra_body={"ignore_eos": True})
    whole = create(client, model_name, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 3 * 12
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1
    chunks = streamed(client, model_name, **kw)
    assert all(len(c.choices) == 1 for c in chunks)
    assert [text_of(chunks, i) for i in range(3)] == texts
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices[0].finish_reason]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]


def test_multi_token_stop_string_never_leaks(client, model_name):
    free = create(client, model_name, messages=COUNT, temperature=0, max_tokens=40).choices[0].message.content
    stop = "5\n6. "
    assert stop in free, free
    expected = free[: free.index(stop)]
    whole = create(client, model_name, messages=COUNT, temperature=0, max_tokens=40, stop=[stop, "zzz"])
    assert whole.choices[0].message.content == expected
    assert (whole.choices[0].finish_reason, whole.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    chunks = streamed(client, model_name, messages=COUNT, temperature=0, max_tokens=40, stop=stop)
    sent = ""
    for c in chunks:
        sent += c.choices[0].delta.content or ""
        assert stop not in sent
        # Text that could still grow into the stop string is held back, never sent.
        assert not any(sent.endswith(stop[:k]) for k in range(1, len(stop)))
    assert sent == expected
    kept = create(
        client,
        model_name,
        messages=COUNT,
        temperature=0,
        max_tokens=40,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content == expected + stop


def test_stop_token_ids_name_the_token(client, model_name, renderer):
    free = create(client, model_name, messages=COUNT, temperature=0, max_tokens=20, logprobs=True)
    tokens = [t.token for t in free.choices[0].logprobs.content]
    [stop_id] = renderer.tokenizer.encode(tokens[4], add_special_tokens=False).ids
    resp = create(
        client, model_name, messages=COUNT, temperature=0, max_tokens=20, extra_body={"stop_token_ids": [stop_id]}
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    assert resp.usage.completion_tokens == tokens.index(tokens[4]) + 1


def test_logprobs_are_well_formed_and_equal_streamed(client, model_name):
    kw = dict(messages=COUNT, temperature=0, max_tokens=15, logprobs=True, top_logprobs=3)
    whole = create(client, model_name, **kw)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens
    assert "".join(e.token for e in entries) == whole.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    chunks = streamed(client, model_name, **kw)
    streamed_entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed_entries] == [
        (e.token, round(e.logprob, 4)) for e in entries
    ]


def test_usage_in_streams(client, model_name):
    chunks = streamed(
        client,
        model_name,
        messages=COUNT,
        temperature=0,
        max_tokens=8,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 8
    running = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage is not None for c in chunks)
    assert running == sorted(running) and running[-1] == 8
    plain = streamed(client, model_name, messages=COUNT, temperature=0, max_tokens=8)
    assert all(c.usage is None for c in plain)


def test_logit_bias_forbids_a_token(client, model_name, renderer):
    free = create(client, model_name, messages=COUNT, temperature=0, max_tokens=10, logprobs=True)
    first = free.choices[0].logprobs.content[0].token
    [banned] = renderer.tokenizer.encode(first, add_special_tokens=False).ids
    biased = create(
        client, model_name, messages=COUNT, temperature=0, max_tokens=10, logprobs=True, logit_bias={str(banned): -100}
    )
    assert first not in [e.token for e in biased.choices[0].logprobs.content]


def test_min_tokens_and_ignore_eos(client, model_name):
    short = [{"role": "user", "content": "Reply with just the word yes."}]
    free = create(client, model_name, messages=short, temperature=0, max_tokens=50)
    assert free.choices[0].finish_reason == "stop"
    at_least = free.usage.completion_tokens + 10
    held = create(
        client, model_name, messages=short, temperature=0, max_tokens=50 + at_least, extra_body={"min_tokens": at_least}
    )
    assert held.usage.completion_tokens >= at_least
    forced = create(client, model_name, messages=short, temperature=0, max_tokens=30, extra_body={"ignore_eos": True})
    assert (forced.usage.completion_tokens, forced.choices[0].finish_reason) == (30, "length")


def test_null_parameters_read_as_left_out(client, model_name):
    # The SDK sends null for a parameter passed as None; defaults that could only be non-null apply instead.
    base = create(client, model_name, messages=COUNT, temperature=0, max_tokens=8)
    nulls = create(
        client,
        model_name,
        messages=COUNT,
        temperature=0,
        max_tokens=8,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        logprobs=None,
        top_logprobs=0,  # vLLM's default: asks for nothing, so it needs no logprobs
        parallel_tool_calls=None,
        extra_body={"stream": None, "repetition_penalty": None, "ignore_eos": None, "min_tokens": None},
    )
    assert len(nulls.choices) == 1 and nulls.choices[0].logprobs is None
    assert nulls.choices[0].message.content == base.choices[0].message.content


def test_penalties_change_greedy_text(client, model_name):
    base = create(client, model_name, messages=COUNT, temperature=0, max_tokens=30).choices[0].message.content
    for extra in ({"frequency_penalty": 1.5}, {"extra_body": {"repetition_penalty": 1.8}}):
        other = create(client, model_name, messages=COUNT, temperature=0, max_tokens=30, **extra)
        assert other.choices[0].message.content != base, extra


def test_continue_final_message_and_echo(client, model_name):
    prefix = "The capital of France is"
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": prefix}]
    kw = dict(messages=messages, temperature=0, max_tokens=8)
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    cont = create(client, model_name, extra_body=extra, **kw).choices[0].message.content
    assert "Paris" in cont and not cont.startswith(prefix)
    echoed = create(client, model_name, extra_body={**extra, "echo": True}, **kw).choices[0].message.content
    assert echoed == prefix + cont
    chunks = streamed(client, model_name, extra_body={**extra, "echo": True}, **kw)
    assert text_of(chunks) == prefix + cont


def test_truncate_prompt_tokens_keeps_the_end(client, model_name):
    resp = create(client, model_name, messages=COUNT, max_tokens=2, extra_body={"truncate_prompt_tokens": 10})
    assert resp.usage.prompt_tokens == 10


def test_request_id_names_the_completion(http: httpx.Client, client, model_name):
    resp = create(
        client,
        model_name,
        messages=COUNT,
        max_tokens=2,
        extra_headers={"X-Request-Id": "abc-123"},
        extra_body={"request_id": "loses-to-header"},
    )
    assert resp.id == "chatcmpl-abc-123"
    again = http.post("/v1/chat/completions", json={"messages": COUNT, "max_tokens": 2, "request_id": "abc-123"})
    assert again.status_code == 409 and again.json()["error"]["param"] == "request_id"
    assert (
        create(client, model_name, messages=COUNT, max_tokens=2, extra_body={"request_id": "xyz"}).id == "chatcmpl-xyz"
    )


def test_stream_accumulates_to_the_whole_completion(client, model_name):
    cases = [
        dict(messages=COUNT, temperature=0, max_tokens=25, logprobs=True, top_logprobs=2),
        dict(messages=COUNT, temperature=0, max_tokens=40, stop=["9"]),
        dict(messages=STORY, temperature=0.8, seed=3, n=2, max_tokens=20),
    ]
    for kw in cases:
        whole = create(client, model_name, **kw)
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(model=model_name, stream=True, **kw):
            state.handle_chunk(chunk)
        acc = state.current_completion_snapshot
        assert acc.id != whole.id and acc.model == whole.model
        for a, w in zip(acc.choices, whole.choices, strict=True):
            assert (a.index, a.message.content, a.finish_reason) == (w.index, w.message.content, w.finish_reason)
            if w.logprobs:
                assert [e.token for e in a.logprobs.content] == [e.token for e in w.logprobs.content]


def test_priority_lets_an_urgent_job_overtake_queued_ones(http: httpx.Client, r, settings):
    # More low-priority jobs than the worker runs at once, then one urgent job: it starts before the waiting ones.
    body = {"messages": COUNT, "max_tokens": 30, "temperature": 0, "background": True, "ignore_eos": True}
    low = [
        http.post("/v1/chat/completions", json={**body, "priority": 5}).json()["id"]
        for _ in range(settings.worker_concurrency + 6)
    ]
    urgent = http.post("/v1/chat/completions", json={**body, "priority": -3}).json()["id"]
    waiting = [j for j in low if http.get(f"/v1/chat/completions/{j}").json()["status"] == "queued"]
    assert waiting, "the worker should not have taken every job yet"
    assert http.get(f"/v1/chat/completions/{urgent}").json()["progress"].get("queue_position") in (None, 1)

    def started(job_id: str) -> float:
        import time

        while not r.hget(keys.job(job_id), "started"):
            time.sleep(0.05)
        return float(r.hget(keys.job(job_id), "started"))

    urgent_at = started(urgent)
    assert all(started(j) >= urgent_at for j in waiting)


def test_legacy_completions(client, model_name, http):
    resp = client.completions.create(
        model=model_name, prompt="The capital of France is", temperature=0, max_tokens=6, echo=True
    )
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert choice.text.startswith("The capital of France is") and len(choice.text) > len("The capital of France is")
    # Logprobs without echo (with it, the prompt's come first: tests/api/test_scoring.py).
    scored = client.completions.create(
        model=model_name, prompt="The capital of France is", temperature=0, max_tokens=6, logprobs=2
    ).choices[0]
    assert len(scored.logprobs.tokens) == 6 and all(len(t) == 2 for t in scored.logprobs.top_logprobs)
    default = client.completions.create(model=model_name, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16
    chunks = list(
        client.completions.create(
            model=model_name, prompt="The capital of France is", temperature=0, max_tokens=6, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text[len("The capital of France is") :]
    frames = stream(http, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert frames[-1].data == "[DONE]" and all(f.id is not None for f in frames)


def test_tokenize_detokenize_version(http, renderer):
    tok = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["tokens"] == renderer.tokenizer.encode("Hello world").ids and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 8192
    chat = http.post("/tokenize", json={"messages": COUNT}).json()
    assert chat["count"] > 10
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    assert http.get("/version").json()["version"]


def test_a_non_streamed_answer_has_every_key_of_vllms_shape(http: httpx.Client):
    # Raw HTTP clients index these keys: a missing one is a KeyError where vLLM gives null.
    body = http.post("/v1/chat/completions", json={"messages": COUNT, "max_tokens": 2}).json()
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
    choice = body["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "stop_reason"}
    message = choice["message"]
    nulls = {"refusal", "annotations", "audio", "function_call", "reasoning"}
    assert set(message) == {"role", "content", *nulls} and all(message[k] is None for k in nulls)
    usage = body["usage"]
    assert set(usage) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    }
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"} and usage["completion_tokens_details"] is None
    text = http.post("/v1/completions", json={"prompt": "Count to 3:", "max_tokens": 2}).json()
    assert (
        text["usage"]["completion_tokens_details"] is None and "cached_tokens" in text["usage"]["prompt_tokens_details"]
    )


def test_streamed_usage_leaves_out_null_details_as_vllm_does(http: httpx.Client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": COUNT, "max_tokens": 3, "stream": True, "stream_options": opts}
    chunks = [f.json for f in stream(http, "POST", "/v1/chat/completions", json=body)[:-1]]
    assert set(chunks[-1]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    # A running usage names the completion details, null without a reasoning parser, and not the prompt's.
    running = [c["usage"] for c in chunks[:-1]]
    assert all(u["completion_tokens_details"] is None and "prompt_tokens_details" not in u for u in running)
    legacy = {"prompt": "Count to 3:", "max_tokens": 3, "stream": True, "stream_options": opts}
    chunks = [f.json for f in stream(http, "POST", "/v1/completions", json=legacy)[:-1]]
    assert all(set(c["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"} for c in chunks[:-1])


def test_a_role_besides_the_five_reaches_the_chat_template(http: httpx.Client, renderer):
    messages = [{"role": "narrator", "content": "The night was dark."}, {"role": "user", "content": "Go on."}]
    body = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    tokenized = http.post("/tokenize", json={"messages": messages}).json()
    assert "<|im_start|>narrator\nThe night was dark." in renderer.tokenizer.decode(
        tokenized["tokens"], skip_special_tokens=False
    )
    assert body["usage"]["prompt_tokens"] == tokenized["count"]
