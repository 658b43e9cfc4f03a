"""A stack whose model thinks: a reasoning parser, a worker chat template (CHATQ_CHAT_TEMPLATE) that opens a thought
after the generation prompt, as Qwen3's and DeepSeek-R1's do, and an API that trusts request templates. On it,
thinking_token_budget ends the thought as vLLM ends it, and a request's own template renders its prompt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from chatq.core.settings import Settings
from chatq.embedded_redis import EmbeddedRedis, free_port
from tests.helpers import assert_error, running_stack, stream, wait_for

THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
END = ["</", "think", ">"]  # the end marker's tokens, as the default model's tokenizer splits it
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("thinking-redis"), persist=False).start()
    settings = Settings(redis_url=server.url, api_port=free_port(), worker_concurrency=8, sse_keepalive=0.25)
    env = {
        "CHATQ_REASONING_PARSER": "qwen3",
        "CHATQ_CHAT_TEMPLATE": THINKING,
        "CHATQ_TRUST_REQUEST_CHAT_TEMPLATE": "true",
    }
    try:
        logs = tmp_path_factory.mktemp("thinking-logs")
        with running_stack(settings, logs, env) as base, httpx.Client(base_url=base, timeout=300) as http:
            yield http
    finally:
        server.stop()


def tokens(choice: dict[str, Any]) -> list[str]:
    return [t["token"] for t in choice["logprobs"]["content"]]


def chat(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"messages": ASK, "max_tokens": 16, "temperature": 0, "logprobs": True} | fields
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def streamed(http: httpx.Client, **fields: Any) -> dict[int, dict[str, str]]:
    body = {"messages": ASK, "max_tokens": 16, "temperature": 0, "stream": True} | fields
    out: dict[int, dict[str, str]] = {}
    for f in stream(http, "POST", "/v1/chat/completions", json=body):
        for c in [] if f.data == "[DONE]" else f.json["choices"]:
            got = out.setdefault(c["index"], {"reasoning": "", "content": ""})
            for key in got:
                got[key] += c["delta"].get(key) or ""
    return out


def test_a_thinking_budget_ends_the_thought_after_that_many_tokens(thinking):
    free = chat(thinking)["choices"][0]
    # The prompt's "\n" after <think> is the thought's first token, as vLLM counts it: 4 more, then the end.
    budgeted = chat(thinking, thinking_token_budget=5)
    [choice] = budgeted["choices"]
    assert END not in [tokens(free)[i : i + 3] for i in range(len(tokens(free)))]  # it would have gone on
    assert tokens(choice)[:4] == tokens(free)[:4] and tokens(choice)[4:7] == END
    message = choice["message"]
    assert message["reasoning"] == "".join(tokens(free)[:4]) and message["content"]
    assert budgeted["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    # Streamed, the same thought and answer.
    assert streamed(thinking, thinking_token_budget=5)[0] == {
        "reasoning": message["reasoning"],
        "content": message["content"],
    }
    # A budget the thought never reaches, and -1, leave the answer as it was; 0 ends the thought at once.
    assert chat(thinking, thinking_token_budget=100)["choices"][0] == free
    assert chat(thinking, thinking_token_budget=-1)["choices"][0] == free
    assert tokens(chat(thinking, thinking_token_budget=1)["choices"][0])[:3] == END


def test_a_thinking_budget_holds_every_choice_a_background_job_and_a_legacy_prompt(thinking):
    sampled = chat(thinking, thinking_token_budget=3, n=2, temperature=1.0, seed=7)
    for choice in sampled["choices"]:
        assert tokens(choice)[2:5] == END, tokens(choice)
    whole = chat(thinking, thinking_token_budget=3)["choices"][0]["message"]
    job = thinking.post(
        "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 16, "temperature": 0, "thinking_token_budget": 3, "background": True},
    ).json()
    done = wait_for(thinking, job["id"], lambda j: j["status"] == "completed")
    assert done["choices"][0]["message"]["content"] == whole["content"]
    legacy = thinking.post(
        "/v1/completions",
        json={"prompt": "Paris or Rome?\n<think>\n", "max_tokens": 8, "temperature": 0, "logprobs": 0}
        | {"thinking_token_budget": 2},
    ).json()
    assert legacy["choices"][0]["logprobs"]["tokens"][1:4] == END


def test_a_thinking_budget_in_the_wrong_shape_is_a_400(thinking):
    for budget in (-2, 1.5, True, "3"):
        resp = thinking.post("/v1/chat/completions", json={"messages": ASK, "thinking_token_budget": budget})
        assert_error(resp, 400, "BadRequestError", "thinking_token_budget")


def test_the_workers_template_and_a_trusted_request_template_render_and_count_alike(thinking):
    prompt = thinking.post("/tokenize", json={"messages": ASK}).json()
    text = thinking.post("/detokenize", json={"tokens": prompt["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # CHATQ_CHAT_TEMPLATE's, not the model's own
    own = "{% for m in messages %}Q: {{ m.content }} {% endfor %}{{ greeting }} A:"
    kwargs = {"chat_template": own, "chat_template_kwargs": {"greeting": "Briefly."}}
    counted = thinking.post("/tokenize", json={"messages": ASK} | kwargs).json()
    text = thinking.post("/detokenize", json={"tokens": counted["tokens"]}).json()["prompt"]
    assert text == "Q: What is the capital of France? Briefly. A:"
    answer = chat(thinking, **kwargs)
    assert answer["usage"]["prompt_tokens"] == counted["count"]
    assert answer["choices"][0]["message"]["reasoning"]  # still read by the stack's parser
