"""Chat completions through the whole stack, driven by the official openai SDK."""

from __future__ import annotations

import json
import uuid

import openai

from chatq.core.chat_request import ChatCompletionRequest
from tests.helpers import stream, wait_for

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_completion_answers_with_usage_matching_the_tokenizer(client: openai.OpenAI, model_name, renderer):
    resp = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=40)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.model == model_name
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    prompt_ids = renderer.render(ChatCompletionRequest(messages=QUESTION)).ids
    assert resp.usage.prompt_tokens == len(prompt_ids)
    # The answer's tokens plus the end-of-turn token that stopped it.
    answer_ids = renderer.tokenizer.encode(choice.message.content, add_special_tokens=False).ids
    assert resp.usage.completion_tokens == len(answer_ids) + 1
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_max_tokens_ends_with_length(client: openai.OpenAI, model_name):
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=7,
        temperature=0,
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7


def test_the_sdk_request_id_is_the_job_id_in_every_mode(client: openai.OpenAI, model_name):
    answer = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2)
    assert answer._request_id == answer.id
    with client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2, stream=True) as stream:
        chunks = list(stream)
        assert stream.response.headers["x-request-id"] == chunks[0].id
    queued = client.chat.completions.with_raw_response.create(
        model=model_name, messages=QUESTION, max_tokens=2, extra_body={"background": True}
    )
    assert queued.status_code == 202 and queued.headers["x-request-id"] == queued.http_response.json()["id"]
    text = client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    assert text._request_id == text.id


def test_model_may_be_omitted(client: openai.OpenAI, model_name):
    resp = client.chat.completions.create(model="", messages=QUESTION, max_tokens=3)
    assert resp.model == model_name


def test_greedy_stream_equals_greedy_completion(client: openai.OpenAI, model_name):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=30)
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            temperature=0,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    assert len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sampling_with_a_seed_is_reproducible(client: openai.OpenAI, model_name):
    def ask() -> str:
        return (
            client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": "Invent a name for a cat."}],
                temperature=1.0,
                top_p=0.9,
                seed=1234,
                max_tokens=20,
            )
            .choices[0]
            .message.content
        )

    assert ask() == ask()


def test_stop_string_is_not_in_the_text(client: openai.OpenAI, model_name):
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    free = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=40)
    text = free.choices[0].message.content
    assert "5" in text, text
    stopped = client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=40, stop=["5"]
    )
    choice = stopped.choices[0]
    assert choice.message.content == text[: text.index("5")]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "5"


def test_models_lists_the_default_model(client: openai.OpenAI, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]


def test_a_stream_with_keep_alives_among_its_events_reads_cleanly(client: openai.OpenAI, http, model_name, settings):
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }
    # Slower than the keep-alive interval, so keep-alives come between events that carry ids.
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        lines = list(resp.iter_lines())
    first_id = next(i for i, line in enumerate(lines) if line.startswith("id:"))
    keep_alives = [line for line in lines[first_id:] if line.startswith(":")]
    assert keep_alives, f"no keep-alive within the stream (one every {settings.sse_keepalive} s)"

    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=body["messages"],
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 48
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_fields_left_out_sample_with_the_models_defaults_and_the_requests_own_win(http, client, model_name):
    card = http.get("/v1/models").json()["data"][0]
    # The default model ships its card's recommended sampling; this stack overrides its repetition penalty of 1.1.
    assert card["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.0}
    ask = {"model": model_name, "messages": QUESTION, "max_tokens": 24}

    def text(seed: int = 7, **fields) -> str:
        return client.chat.completions.create(**ask, seed=seed, **fields).choices[0].message.content

    left_out = text()
    assert left_out == text(temperature=0.2, top_p=0.9)
    assert "Paris" in left_out
    assert text(temperature=1.5) != left_out  # the request's own temperature is what runs, under the same seed
    # n > 1 is refused only when the temperature that runs is greedy: the model's default is not.
    assert len(client.chat.completions.create(**ask, seed=7, n=2).choices) == 2


SYSTEM = "You are a careful assistant for a bakery. " * 12


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_count_the_prompt_the_prefix_cache_served(http, model_name):
    system = [{"role": "system", "content": f"{uuid.uuid4().hex} {SYSTEM}"}]

    def ask(question: str, **fields) -> dict:
        messages = [*system, {"role": "user", "content": question}]
        return http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **fields}).json()

    first = ask("When do you open?")
    assert _cached(first) == 0
    again = ask("Do you sell rye bread?")
    # The system prompt's whole blocks, not the question nor the last prompt token.
    assert 100 <= _cached(again) < again["usage"]["prompt_tokens"]
    assert _cached(again) % 16 == 0
    frames = stream(
        http,
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [*system, {"role": "user", "content": "Any cakes?"}],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    usage = json.loads(frames[-2].data)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == _cached(again)
    job = ask("Any pies?", background=True)
    done = wait_for(http, job["id"], lambda j: j["status"] == "completed")
    assert _cached(done) == _cached(again)
    text = {"model": model_name, "prompt": system[0]["content"] + " Hours?", "max_tokens": 2}
    http.post("/v1/completions", json=text)
    assert _cached(http.post("/v1/completions", json=text).json()) >= 96
