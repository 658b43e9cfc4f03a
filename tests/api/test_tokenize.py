"""/tokenize counts the prompt a chat request would run with, whatever its template makes of the request."""

from __future__ import annotations

import dataclasses
import time

from chatq.core import keys
from chatq.core.registry import entry, register
from tests.helpers import assert_error, model_info

TEMPLATE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{% for d in documents or [] %}DOC {{ d.text }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


def test_tokenize_counts_what_the_template_makes_of_tools_and_documents(http, r):
    # A model whose template writes the tools and documents into the prompt, as tool-calling models' templates do,
    # registered as its worker would register it: the API renders with it, having no files of its own.
    info = dataclasses.replace(model_info(), name="model-with-a-tools-template", chat_templates={"default": TEMPLATE})
    register(r, entry(info))
    messages = [{"role": "user", "content": "What is the weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    documents = [{"text": "It rains in Paris."}]
    try:
        request = {"model": info.name, "messages": messages}
        # The API reads the registry anew at most every 0.1 s on a miss: a reading under way may predate the entry.
        deadline = time.time() + 10
        while (resp := http.post("/tokenize", json=request)).status_code == 404:
            assert time.time() < deadline, resp.text
            time.sleep(0.1)
        plain = resp.json()
        full = http.post("/tokenize", json=request | {"tools": tools, "documents": documents}).json()
        text = http.post("/detokenize", json={"model": info.name, "tokens": full["tokens"]}).json()["prompt"]
    finally:
        r.delete(keys.model(info.name))
        r.srem(keys.models(), info.name)
    assert full["count"] > plain["count"]
    assert text.startswith("TOOL get_weather\nDOC It rains in Paris.\nuser: What is the weather?")


def test_a_requests_own_template_is_refused_by_tokenize_as_by_chat_unless_trusted(http):
    # The default stack does not trust request templates (CHATQ_TRUST_REQUEST_CHAT_TEMPLATE); tests/test_reasoning.py
    # runs one that does.
    own = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ messages[0].content }}"}
    for path in ("/tokenize", "/v1/chat/completions"):
        error = assert_error(http.post(path, json=own), 400, "BadRequestError", "chat_template")
        assert "CHATQ_TRUST_REQUEST_CHAT_TEMPLATE" in error["message"]
