"""The render stage: chat messages -> prompt token ids, through the model's own chat template.

Needs only `tokenizers` and jinja2 (no torch, no transformers), so the API runs it at submit time: template errors
and over-long prompts are refused with a 400 before anything is enqueued, and the job carries its prompt ids.
The jinja environment mirrors transformers' `apply_chat_template` so templates written for it render the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from chatq.core.protocol import ChatCompletionRequest, RequestError


class TemplateError(RequestError):
    pass


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Renderer:
    """Holds one model's tokenizer and chat template."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        if template is None:
            raise RuntimeError(f"{model_dir} has no chat template")
        self.special = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in self.special.items()}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        # Some models ship several named templates ([{"name": "default", ...}, {"name": "tool_use", ...}]);
        # transformers and vLLM use `tool_use` for a request with tools, when there is one, and `default` otherwise.
        named = {t["name"]: t["template"] for t in template} if isinstance(template, list) else {"default": template}
        if "default" not in named:
            raise RuntimeError(f"{model_dir} names chat templates but none `default`: {sorted(named)}")
        self.templates = {name: env.from_string(source) for name, source in named.items()}
        self.content_parts = {name: _loops_over_content(env.parse(source)) for name, source in named.items()}

    @cached_property
    def eos_token_ids(self) -> list[int]:
        ids = []
        gen = self.model_dir / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        token = self.special.get("eos_token")
        if token is not None and (tid := self.tokenizer.token_to_id(token)) is not None and tid not in ids:
            ids.append(tid)
        return ids

    def render(self, request: ChatCompletionRequest) -> Prompt:
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        name = "tool_use" if tools and "tool_use" in self.templates else "default"
        messages = []
        for i, m in enumerate(request.messages):
            d = m.model_dump(exclude_none=True)
            # A template that loops over a message's content gets it as text parts, whether it came as a string or
            # as parts; any other gets one string (vLLM's "openai" and "string" content formats). A tool's result
            # is one string either way, as vLLM passes it.
            if self.content_parts[name] and m.role != "tool":
                d["content"] = [{"type": "text", "text": t} for t in m.texts()]
            else:
                d["content"] = m.text() or ""
            if "reasoning" in d:  # templates read either name (Qwen3's: reasoning_content); vLLM passes both
                d["reasoning_content"] = d["reasoning"]
            if m.tool_calls:
                d["tool_calls"] = [
                    _call_for_template(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)
                ]
            messages.append(d)
        # Tool definitions go to the template, which decides how the model sees them (as vLLM does).
        context: dict[str, Any] = {
            **self.special,
            "tools": tools,
            "add_generation_prompt": request.add_generation_prompt and not request.continue_final_message,
        }
        if request.reasoning_effort is not None:
            context["reasoning_effort"] = request.reasoning_effort
            context["enable_thinking"] = request.thinking
        if request.documents is not None:
            context["documents"] = request.documents
        kwargs = request.chat_template_kwargs or {}
        if "messages" in kwargs:
            raise TemplateError("chat_template_kwargs cannot replace the messages.", "chat_template_kwargs")
        # What the request gives the template wins over what chatq would, as in vLLM.
        context.update(kwargs)
        try:
            text = self.templates[name].render(messages=messages, **context)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"The chat template could not render these messages: {e}", "messages") from e
        if request.continue_final_message:
            # Cut the rendering right after the final message's text, leaving its turn open to be continued
            # (what transformers' apply_chat_template does).
            last = request.messages[-1]
            if self.content_parts[name] and last.role != "tool":  # continued after its last text part, as there
                parts = last.texts()
                if not parts:
                    raise TemplateError("The final message has no text to continue.", "continue_final_message")
                final = parts[-1]
            else:
                final = last.text() or ""
            final = final if final in text else final.strip()
            if final not in text:
                raise TemplateError(
                    "The chat template does not show the final message verbatim, so it cannot be continued.",
                    "continue_final_message",
                )
            text = text[: text.rindex(final) + len(final)]
        ids = self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens).ids
        return Prompt(text=text, ids=ids)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A legacy completion's prompt: text is tokenized (with the model's special tokens unless told otherwise),
        ids are taken as is."""
        if isinstance(prompt, list):
            return list(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids


def _call_for_template(call: dict[str, Any], param: str) -> dict[str, Any]:
    """An earlier assistant turn's tool call with its arguments as an object, as vLLM hands it to templates: the
    wire carries them as a JSON string, and templates write them with `tojson`, which would quote that string again."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise RequestError(f"Tool call arguments are not valid JSON: {e}", f"{param}.function.arguments") from e
        except RecursionError as e:
            message = "Tool call arguments are nested too deeply to read."
            raise RequestError(message, f"{param}.function.arguments") from e
    return {**call, "function": {**function, "arguments": arguments}}


def _loops_over_content(template: jinja2.nodes.Template) -> bool:
    """Whether a chat template iterates over a message's content (`{% for part in message['content'] %}`), and so
    wants it as a list of parts. Written here as vLLM detects it (no library does): follow the names bound to
    `messages` (assignments, then loop targets over them) to loops over their `content`."""

    def reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
        # `x`, `x[k]` or `x.k`, through filters, tests and slices (`messages | reverse`, `messages[1:]`)
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        ):
            if node.node is None:
                return False
            node = node.node
        if key is not None:
            if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
                attr = node.arg.value
            elif isinstance(node, jinja2.nodes.Getattr):
                attr = node.attr
            else:
                return False
            if attr != key:
                return False
            node = node.node
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names

    def bound(names: set[str]) -> set[str]:
        # every name assigned from one of `names`, transitively
        found, grew = set(names), True
        while grew:
            grew = False
            for a in template.find_all(jinja2.nodes.Assign):
                if isinstance(a.target, jinja2.nodes.Name) and a.target.name not in found and reads(a.node, found):
                    found.add(a.target.name)
                    grew = True
        return found

    lists = bound({"messages"})
    loops = list(template.find_all(jinja2.nodes.For))
    items = {f.target.name for f in loops if isinstance(f.target, jinja2.nodes.Name) and reads(f.iter, lists)}
    return any(reads(f.iter, items, "content") for f in loops)
