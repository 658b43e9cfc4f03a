"""The render stage: chat template -> prompt ids, as transformers' apply_chat_template would render them."""

from __future__ import annotations

import json
import shutil

import pytest

from chatq.core.chat_request import ChatCompletionRequest
from chatq.core.errors import BadRequest
from chatq.core.model_info import ModelInfo
from chatq.core.render import Renderer
from chatq.core.settings import Settings

TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> Renderer:
    d = tmp_path_factory.mktemp("model")
    shutil.copy(Settings().model_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return Renderer(ModelInfo.read("test-model", d, max_model_len=2048))


def req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "Hi"}], **kw})


def test_generation_prompt_and_ids(renderer):
    p = renderer.render(req())
    assert p.text == "<user>Hi</user>\n<assistant>"
    assert renderer.tokenizer.decode(p.ids) == p.text


def test_tools_reach_the_template(renderer):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    assert renderer.render(req(tools=[tool])).text.startswith("TOOLS:get_weather\n")


def test_history_reaches_the_template_as_vllm_hands_it(tmp_path):
    # Tool-call arguments as objects (a template writes them with tojson), reasoning under both names, documents,
    # reasoning_effort.
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments | tojson }}\n"
        "{% endfor %}{% if m.reasoning_content %}THOUGHT {{ m.reasoning_content }}={{ m.reasoning }}\n{% endif %}"
        "{% endfor %}{% for d in documents or [] %}DOC {{ d.text }}\n{% endfor %}EFFORT {{ reasoning_effort }} "
        "{{ enable_thinking }}"
    )
    shutil.copy(Settings().model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": calls},
    ]
    request = req(messages=messages, documents=[{"text": "Paris is sunny."}], reasoning_effort="low")
    text = Renderer(ModelInfo.read("test-model", tmp_path, max_model_len=2048)).render(request).text
    expected = 'CALL {"city": "Paris"}\nCALL {}\nTHOUGHT Look it up.=Look it up.\nDOC Paris is sunny.\nEFFORT low True'
    assert text == expected


@pytest.mark.parametrize("arguments", ["{city: Paris", "[" * 5000 + "]" * 5000])
def test_tool_call_arguments_that_are_not_json_are_a_request_error(renderer, arguments):
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    with pytest.raises(BadRequest) as e:
        renderer.render(req(messages=messages))
    assert e.value.param == "messages.1.tool_calls.0.function.arguments"


def test_continue_final_message_leaves_the_turn_open(renderer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    p = renderer.render(req(messages=messages, add_generation_prompt=False, continue_final_message=True))
    assert p.text == "<user>Hi</user>\n<assistant>Hello the"


def test_template_errors_are_request_errors(renderer):
    with pytest.raises(BadRequest) as e:
        renderer.render(req(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]))
    assert "no tool turns" in e.value.message and e.value.param == "messages"


def test_add_special_tokens_adds_the_tokenizers_own(tmp_path):
    # SmolLM2's tokenizer adds nothing; give it a BOS, as Llama's and Mistral's have, to see the switch work.
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(str(Settings().model_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    r = Renderer(ModelInfo.read("test-model", tmp_path, max_model_len=2048))
    # Chat: off by default, as in vLLM, since templates write their own BOS.
    assert r.render(req()).ids[0] != bos
    assert r.render(req(add_special_tokens=True)).ids == [bos, *r.render(req()).ids]
    # Legacy text prompts: on by default.
    assert r.encode("Hello")[0] == bos
    assert r.encode("Hello", add_special_tokens=False) == r.encode("Hello")[1:]
    assert r.encode([5, 6], add_special_tokens=True) == [5, 6]


def test_chat_template_kwargs_win_over_what_chatq_passes(renderer):
    # As in vLLM, the request's kwargs are applied last: here the generation prompt is switched off by them.
    assert renderer.render(req(chat_template_kwargs={"add_generation_prompt": False})).text == "<user>Hi</user>\n"
    with pytest.raises(BadRequest):
        renderer.render(req(chat_template_kwargs={"messages": []}))


def test_a_model_with_named_templates_uses_tool_use_for_requests_with_tools(tmp_path):
    model_dir = Settings().model_dir
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}PLAIN {{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "{% for m in messages %}TOOLS {{ m.content }}{% endfor %}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    renderer = Renderer(ModelInfo.read("test-model", tmp_path, max_model_len=2048))
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert renderer.render(req(messages=messages)).text == "PLAIN hi"
    assert renderer.render(req(messages=messages, tools=tools)).text == "TOOLS hi"


def renderer_of(tmp_path, template: str) -> Renderer:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "tokenizer.json").write_bytes((Settings().model_dir / "tokenizer.json").read_bytes())
    return Renderer(ModelInfo.read("test-model", tmp_path, max_model_len=2048))


PARTS = "{% for m in messages %}<{{ m.role }}>{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    "template",
    [
        PARTS,
        # the messages reached through a name bound to them, and the content through a filter
        "{% set ms = messages | list %}{% for m in ms %}<{{ m.role }}>"
        "{% for p in m.content | list %}[{{ p.text }}]{% endfor %}{% endfor %}",
    ],
)
def test_a_template_that_loops_over_content_gets_text_parts_however_the_content_came(tmp_path, template):
    renderer = renderer_of(tmp_path, template)
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    assert renderer.render(req(messages=messages)).text == "<system>[Be brief.]<user>[a][b]"


def test_a_template_that_prints_content_gets_one_string(tmp_path):
    renderer = renderer_of(tmp_path, "{% for m in messages %}<{{ m.content }}>{% endfor %}")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert renderer.render(req(messages=[{"role": "user", "content": parts}])).text == "<a\nb>"
    # The default model's template is one of these.
    assert {
        name: t.content_parts for name, t in Renderer(ModelInfo.read("SmolLM2", Settings().model_dir)).templates.items()
    } == {"default": False}


def test_a_final_message_given_as_parts_is_continued_after_its_last_part(tmp_path):
    renderer = renderer_of(tmp_path, PARTS + "END")
    parts = [{"type": "text", "text": "Yo"}, {"type": "text", "text": "there"}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": parts}]
    prompt = renderer.render(req(messages=messages, continue_final_message=True, add_generation_prompt=False))
    assert prompt.text == "<user>[Hi]<assistant>[Yo][there"
    with pytest.raises(BadRequest):
        messages[-1]["content"] = []
        renderer.render(req(messages=messages, continue_final_message=True, add_generation_prompt=False))


def test_a_tool_result_is_one_string_even_for_a_template_that_loops_over_content(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}TOOL:{{ m.content }}"
        "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}"
    )
    renderer = renderer_of(tmp_path, template)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "tool", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}]},
    ]
    assert renderer.render(req(messages=messages)).text == "[Hi]TOOL:4\n2"


def test_a_request_brings_its_own_template_only_where_trusted(tmp_path, renderer):
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    for fields in ({"chat_template": own}, {"chat_template_kwargs": {"chat_template": own}}):
        with pytest.raises(BadRequest, match="CHATQ_TRUST_REQUEST_CHAT_TEMPLATE is not set") as refused:
            renderer.render(req(**fields))
        assert refused.value.param == next(iter(fields))
    shutil.copy(Settings().model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    trusting = Renderer(ModelInfo.read("test-model", tmp_path, max_model_len=2048), trust_request_templates=True)
    assert trusting.render(req(chat_template=own)).text == "[user] Hi\n"
    assert trusting.render(req(chat_template_kwargs={"chat_template": own})).text == "[user] Hi\n"
    assert trusting.render(req()).text == "<user>Hi</user>\n<assistant>"  # none given: the model's own
    with pytest.raises(BadRequest, match="not a valid template") as broken:
        trusting.render(req(chat_template="{% for m in messages %}"))
    assert broken.value.param == "chat_template"
    # Sandboxed all the same: a template reaching for Python's internals is refused, not run.
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(BadRequest, match="could not render"):
        trusting.render(req(chat_template=escape))


def test_a_worker_template_setting_replaces_the_models_own(tmp_path):
    shutil.copy(Settings().model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    named = [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    own = "{% for m in messages %}{{ m.content }};{% endfor %}"
    (tmp_path / "own.jinja").write_text(own)
    for setting in (str(tmp_path / "own.jinja"), own):
        info = ModelInfo.read("test-model", tmp_path, max_model_len=2048, chat_template=setting)
        assert info.chat_templates == {"default": own}
        tool = {"type": "function", "function": {"name": "f"}}
        assert Renderer(info).render(req(tools=[tool])).text == "Hi;"
    with pytest.raises(RuntimeError, match="CHATQ_CHAT_TEMPLATE"):
        ModelInfo.read("test-model", tmp_path, max_model_len=2048, chat_template=str(tmp_path / "missing.jinja"))
