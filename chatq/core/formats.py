"""Output formats a request holds its answer to: response_format and structured_outputs, and their checks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from chatq.core.errors import BadRequest
from chatq.core.schemas import check_schema


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str  # required, as OpenAI and vLLM have it
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class StructuralTagItem(BaseModel):
    """One of a structural tag's older `structures`: text from `begin` to `end`, a JSON value of `schema` between."""

    model_config = ConfigDict(populate_by_name=True)

    begin: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag: xgrammar's `format`, as vLLM takes it, or the older `structures` and `triggers`.
    format: dict[str, Any] | None = None
    structures: list[StructuralTagItem] | None = None
    triggers: list[str] | None = None

    def structural_tag(self) -> dict[str, Any]:
        """The structural tag as xgrammar takes it (vLLM's payload): the format, or the structures and triggers."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude={"json_schema"})


class StructuredOutputs(BaseModel):
    """vLLM's constraint kinds; exactly one may be given."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # a JSON text, as vLLM takes it: what response_format structural_tag holds

    # vLLM's other options here (json_object, disable_any_whitespace, whitespace_pattern, ...) are not honoured: one
    # that asks for something (not null or false) is refused in check(), rather than dropped.
    model_config = ConfigDict(populate_by_name=True, extra="allow")

    def kinds(self) -> list[str]:
        return [
            k
            for k, v in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("structural_tag", self.structural_tag),
            )
            if v is not None
        ]


def json_text(text: str, name: str) -> Any:
    """A structured_outputs field given as JSON text, read strictly, as request bodies are: no NaN or Infinity
    (1e400), which xgrammar cannot take."""
    try:
        return orjson.loads(text)
    except ValueError as e:
        raise BadRequest(f"structured_outputs.{name} is not valid JSON: {e}", "structured_outputs") from e


def check_structural_tag(tag: Any, param: str) -> None:
    """What the API can check of a structural tag without xgrammar: its shape, and every JSON schema in it. What
    only xgrammar reads (a format's kinds) fails the job with a 400 when its grammar is compiled."""
    invalid = f"Invalid {param} structural_tag specification"
    if not isinstance(tag, dict):
        raise BadRequest(f"{invalid}: it must be a JSON object.", param)
    if "structures" in tag:  # the older form
        try:
            ResponseFormat.model_validate({"type": "structural_tag", **tag})
        except ValueError as e:
            raise BadRequest(f"{invalid}: {e}", param) from e
        if not isinstance(tag.get("triggers"), list) or not tag["triggers"]:
            raise BadRequest(f"{invalid}: `structures` need `triggers`.", param)
        for item in tag["structures"]:
            if not any(item["begin"].startswith(t) for t in tag["triggers"]):
                raise BadRequest(f"{invalid}: the begin {item['begin']!r} starts with no trigger.", param)
            check_schema(item.get("schema") or {}, param)
        return
    if not isinstance(tag.get("format"), dict):
        raise BadRequest(f"{invalid}: it needs a `format` object (or the older `structures` and `triggers`).", param)
    for schema in _schemas_in(tag["format"]):
        check_schema(schema, param)


def _schemas_in(node: Any) -> Iterator[dict[str, Any]]:
    """The JSON schemas of a structural tag's format: those of its `json_schema` parts, however deep."""
    if isinstance(node, list):
        for item in node:
            yield from _schemas_in(item)
    elif isinstance(node, dict):
        if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            yield node["json_schema"]
        for value in node.values():
            yield from _schemas_in(value)
