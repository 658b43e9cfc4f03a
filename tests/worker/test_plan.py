"""The plan stage: what the model's generation_config and the request together ask of sampling."""

from __future__ import annotations

import pytest

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.errors import BadRequest
from chatq.core.model_info import sampling_defaults
from chatq.core.settings import Settings
from chatq.worker.grammar import GrammarError
from chatq.worker.plan import grammar_for, sampling_params, thinking_budget
from tests.helpers import model_info

MESSAGES = [{"role": "user", "content": "hi"}]


def test_generation_config_fills_what_the_request_leaves_out(tmp_path):
    config = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "bos_token_id": 1,
    }
    defaults = sampling_defaults(config, {})
    (p,) = sampling_params(ChatCompletionRequest(messages=MESSAGES), 10, frozenset({2}), defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)

    # Explicit values win, and null takes the model's default as leaving the field out does; without a
    # generation_config the defaults are neutral.
    body = {"messages": MESSAGES, "temperature": 0.0, "min_p": 0.0, "repetition_penalty": None, "top_k": None}
    (p,) = sampling_params(ChatCompletionRequest.model_validate(body), 10, frozenset({2}), defaults)
    assert (p.temperature, p.min_p, p.repetition_penalty, p.top_k) == (0.0, 0.0, 1.1, 20)
    (p,) = sampling_params(ChatCompletionRequest(messages=MESSAGES), 10, frozenset({2}), sampling_defaults({}, {}))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_the_defaults_are_the_fields_vllm_reads_with_the_override_over_them():
    config = {"temperature": 0.6, "presence_penalty": 0.5, "max_new_tokens": 64, "top_k": None, "do_sample": True}
    assert sampling_defaults(config, {}) == {"temperature": 0.6, "presence_penalty": 0.5, "max_tokens": 64}
    override = {"temperature": 0.1, "frequency_penalty": 0.3, "max_new_tokens": None}
    assert sampling_defaults(config, override) == {
        "temperature": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
    }
    (p,) = sampling_params(ChatCompletionRequest(messages=MESSAGES), 10, frozenset({2}), sampling_defaults(config, {}))
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.0)


def test_a_grammar_that_cannot_compile_is_reported_against_the_field_that_asked_for_it():
    class Refusing:  # a grammar engine that compiles nothing
        def __getattr__(self, name):
            def refuse(*args, **kwargs):
                raise GrammarError("cannot compile")

            return refuse

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    asks = [
        ({"tools": tools, "tool_choice": "required"}, "tools"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ]
    for fields, param in asks:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
        with pytest.raises(BadRequest) as e:
            grammar_for(req, Refusing())  # type: ignore[arg-type]
        assert e.value.param == param, fields


def test_a_thinking_budget_needs_a_reasoning_parser_and_takes_its_markers_as_token_ids():
    tokenizer = model_info().tokenizer
    req = ChatCompletionRequest(messages=MESSAGES, thinking_token_budget=8)
    # As vLLM without --reasoning-parser refuses it.
    with pytest.raises(BadRequest, match="CHATQ_REASONING_PARSER") as e:
        thinking_budget(req, Settings(), tokenizer)
    assert e.value.param == "thinking_token_budget"
    budget = thinking_budget(req, Settings(reasoning_parser="qwen3"), tokenizer)
    assert budget is not None and budget.tokens == 8
    assert tokenizer.decode(list(budget.start)) == "<think>" and tokenizer.decode(list(budget.end)) == "</think>"
    unlimited = ChatCompletionRequest(messages=MESSAGES, thinking_token_budget=-1)
    assert thinking_budget(unlimited, Settings(reasoning_parser="qwen3"), tokenizer) is None
