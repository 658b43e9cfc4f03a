"""The render stage: chat messages -> prompt token ids, through the model's own chat template.

Needs only `tokenizers` and jinja2 (no torch), so the API renders at submit time: template errors and over-long
prompts are a 400 before anything is enqueued, and the job carries its prompt ids. Its jinja environment mirrors
transformers' `apply_chat_template`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from chatq.core.chat_request import ChatCompletionRequest, Message
from chatq.core.errors import BadRequest
from chatq.core.model_info import ModelInfo
from chatq.core.requests import MAX_BAD_WORDS


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


# A request's own chat templates kept compiled, as clients send the same one again and again.
REQUEST_TEMPLATES_KEPT = 64
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but CHATQ_TRUST_REQUEST_CHAT_TEMPLATE is not set. Refused request with "
    "untrusted chat template."
)


@dataclass(frozen=True)
class Template:
    compiled: jinja2.Template
    content_parts: bool  # whether it loops over a message's content, and so takes it as a list of parts


class Renderer:
    """Renders requests with one model's tokenizer and chat templates, or a request's own where trusted, every one in
    a sandbox: a template is code, and the model's files or a client may hold anything."""

    def __init__(self, model: ModelInfo, *, trust_request_templates: bool = False):
        self.tokenizer = model.tokenizer
        self.special = model.special_tokens
        self.trust_request_templates = trust_request_templates
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.env = env
        # transformers and vLLM use a model's `tool_use` template for a request with tools, `default` otherwise.
        self.templates = {name: self._compile(source) for name, source in model.chat_templates.items()}
        self._requested: dict[str, Template] = {}
        self._lock = threading.Lock()

    def render(self, request: ChatCompletionRequest) -> Prompt:
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        template = self._template(request, tools)
        messages = [self._message(m, i, template.content_parts) for i, m in enumerate(request.messages)]
        try:
            text = template.compiled.render(messages=messages, **self._context(request, tools))
        except jinja2.exceptions.TemplateError as e:
            raise BadRequest(f"The chat template could not render these messages: {e}", "messages") from e
        if request.continue_final_message:
            text = _cut_after_final(text, request.messages[-1], template.content_parts)
        return Prompt(text=text, ids=self._ids(text, request.add_special_tokens))

    def _template(self, request: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> Template:
        """The request's own template if it brings one (as `chat_template`, or in `chat_template_kwargs` as vLLM
        also reads it), else the model's."""
        source = request.chat_template
        param = "chat_template"
        if source is None and (request.chat_template_kwargs or {}).get("chat_template") is not None:
            source, param = request.chat_template_kwargs["chat_template"], "chat_template_kwargs"  # type: ignore[index]
        if source is None:
            return self.templates["tool_use" if tools and "tool_use" in self.templates else "default"]
        if not self.trust_request_templates:
            raise BadRequest(UNTRUSTED_TEMPLATE, param)
        if not isinstance(source, str):
            raise BadRequest("A chat template must be a string.", param)
        with self._lock:
            template = self._requested.get(source)
        if template is None:
            try:
                template = self._compile(source)
            except jinja2.exceptions.TemplateError as e:
                raise BadRequest(f"The chat template is not a valid template: {e}", param) from e
            with self._lock:
                if len(self._requested) >= REQUEST_TEMPLATES_KEPT:
                    self._requested.pop(next(iter(self._requested)))
                self._requested[source] = template
        return template

    def _compile(self, source: str) -> Template:
        return Template(self.env.from_string(source), _loops_over_content(self.env.parse(source)))

    @staticmethod
    def _message(m: Message, i: int, as_parts: bool) -> dict[str, Any]:
        """A message as templates read it, as vLLM hands it to them."""
        d = m.model_dump(exclude_none=True)
        # A template that loops over content gets text parts (even from a string), any other one string (vLLM's
        # "openai" and "string" content formats); a tool's result is always one string.
        if as_parts and m.role != "tool":
            d["content"] = [{"type": "text", "text": t} for t in m.texts()]
        else:
            d["content"] = m.text() or ""
        if "reasoning" in d:  # templates read either name (Qwen3's: reasoning_content); vLLM passes both
            d["reasoning_content"] = d["reasoning"]
        if m.tool_calls:
            d["tool_calls"] = [
                _call_for_template(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)
            ]
        return d

    def _context(self, request: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The template's variables besides the messages. Tool definitions go to the template, which decides how the
        model sees them (as vLLM does)."""
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
        kwargs = {k: v for k, v in (request.chat_template_kwargs or {}).items() if k != "chat_template"}
        if "messages" in kwargs:
            raise BadRequest("chat_template_kwargs cannot replace the messages.", "chat_template_kwargs")
        # What the request gives the template wins over what chatq would, as in vLLM.
        return context | kwargs

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A legacy completion's prompt: text is tokenized (with the model's special tokens unless told otherwise),
        ids are taken as is."""
        if isinstance(prompt, list):
            return list(prompt)
        return self._ids(prompt, add_special_tokens)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while it runs, so a long prompt tokenized
        # in a thread leaves the API's event loop running.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def bad_words_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences `bad_words` forbid, as vLLM makes them: each word as it begins a text and, where that
    differs by its first token only, as it follows a space; a word's last token is then blocked after the rest."""
    found: list[list[int]] = []
    for word in dict.fromkeys(words):
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
        if not bare:
            raise BadRequest("bad_words entries must tokenize to at least one token.", "bad_words")
        found.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    if len(found) > MAX_BAD_WORDS:
        raise BadRequest(
            f"Too many bad words after tokenization: {len(found)}. The max number is {MAX_BAD_WORDS}.", "bad_words"
        )
    return found


def _cut_after_final(text: str, last: Message, as_parts: bool) -> str:
    """The rendering cut right after the final message's text, leaving its turn open to be continued (what
    transformers' apply_chat_template does); a message in parts is continued after its last part."""
    if as_parts and last.role != "tool":
        parts = last.texts()
        if not parts:
            raise BadRequest("The final message has no text to continue.", "continue_final_message")
        final = parts[-1]
    else:
        final = last.text() or ""
    final = final if final in text else final.strip()
    if final not in text:
        raise BadRequest(
            "The chat template does not show the final message verbatim, so it cannot be continued.",
            "continue_final_message",
        )
    return text[: text.rindex(final) + len(final)]


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
            raise BadRequest(f"Tool call arguments are not valid JSON: {e}", f"{param}.function.arguments") from e
        except RecursionError as e:
            message = "Tool call arguments are nested too deeply to read."
            raise BadRequest(message, f"{param}.function.arguments") from e
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
