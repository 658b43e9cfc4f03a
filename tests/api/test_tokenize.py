"""/tokenize counts the prompt a chat request would run with, whatever its template makes of the request."""

from __future__ import annotations

from fastapi.testclient import TestClient

from chatq.api.app import create_app


def test_tokenize_counts_what_the_template_makes_of_tools_and_documents(settings, tmp_path):
    # A model whose template writes the tools and documents into the prompt, as tool-calling models' templates do.
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((settings.model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for d in documents or [] %}DOC {{ d.text }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    app = create_app(settings.model_copy(update={"model": str(tmp_path)}))
    messages = [{"role": "user", "content": "What is the weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    documents = [{"text": "It rains in Paris."}]
    with TestClient(app) as c:
        plain = c.post("/tokenize", json={"messages": messages}).json()
        full = c.post("/tokenize", json={"messages": messages, "tools": tools, "documents": documents}).json()
        text = c.post("/detokenize", json={"tokens": full["tokens"]}).json()["prompt"]
    assert full["count"] > plain["count"]
    assert text.startswith("TOOL get_weather\nDOC It rains in Paris.\nuser: What is the weather?")
