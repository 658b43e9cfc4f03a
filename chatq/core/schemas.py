"""Which JSON schemas and regexes the grammar engine compiles and enforces, checked before a job exists.

The API cannot load xgrammar (it imports torch), so a schema or regex it would refuse, or compile without
enforcing, is found here and answered with a 400 rather than a failed job or an answer that does not match.
"""

from __future__ import annotations

import math
import re
from typing import Any

from chatq.core import regex_dialect
from chatq.core.errors import BadRequest


def check_schema(schema: Any, param: str, constrains: bool = True) -> None:
    """A JSON schema must be valid JSON Schema that the worker's grammar engine can compile, so a bad one is a 400
    here and never a failed job; one that will constrain the output (`constrains`) must also use only what the
    grammar engine enforces."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, dict):
        raise BadRequest("A JSON schema must be an object.", param)
    try:
        Draft202012Validator.check_schema(schema)
        found = _schema_problem(schema, schema, constrains)
    except SchemaError as e:
        raise BadRequest(f"Invalid JSON schema: {e.message}", param) from e
    except RecursionError as e:
        raise BadRequest("The JSON schema is nested too deeply.", param) from e
    if found is not None:
        raise BadRequest(f"Invalid JSON schema: {found}", param)
    if constrains and (found := size_problem(schema)) is not None:
        raise BadRequest(f"The JSON schema is larger than the grammar engine takes: {found}.", param)


# OpenAI's limits on a structured output's schema. Past them the grammar engine's compile time grows faster than the
# schema (an enum of 60,000 strings takes many minutes), in a call that a cancel cannot stop.
MAX_ENUM_VALUES = 1000
MAX_PROPERTIES = 5000
MAX_SCHEMA_CHARS = 120_000
# Not OpenAI's: the grammar engine's compile time grows with the cube of one object's properties (seconds at 1,000,
# minutes at 5,000), where properties spread over many objects cost little.
MAX_OBJECT_PROPERTIES = 500


def size_problem(schema: Any) -> str | None:
    """Which of OpenAI's limits the schema passes, in words: its enum values, its properties, or the length of its
    property names, definition names, enum values and consts together."""
    values = properties = widest = chars = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key == "enum" and isinstance(value, list):
                values += len(value)
                chars += sum(len(v) for v in value if isinstance(v, str))
            elif key == "const" and isinstance(value, str):
                chars += len(value)
            elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                if key == "properties":
                    properties, widest = properties + len(value), max(widest, len(value))
                chars += sum(len(k) for k in value)
            if isinstance(value, (dict, list)):
                stack.append(value)
    return (
        _over(values, MAX_ENUM_VALUES, "enum values")
        or _over(properties, MAX_PROPERTIES, "properties")
        or _over(widest, MAX_OBJECT_PROPERTIES, "properties in one object")
        or _over(chars, MAX_SCHEMA_CHARS, "characters of names, enum values and consts")
    )


def _over(count: int, limit: int, what: str) -> str | None:
    return f"{count} {what}, more than {limit}" if count > limit else None


_BOUNDS = (
    ("minimum", "maximum"),
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


# Keywords xgrammar compiles without enforcing (it warns, then allows what they forbid), so an answer could finish
# "stop" yet not match its schema. Refused: nothing else checks answers against them.
_UNENFORCED = (
    "not",
    "if",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedItems",
    "unevaluatedProperties",
)
# Where a schema holds schemas: name -> schema maps, lists of schemas, single schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")


def _subschemas(node: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out += node[key].values()
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out += node[key]
    out += [node[key] for key in _SCHEMA_ONE if key in node]
    return out


def _range_problem(node: dict[str, Any]) -> str | None:
    """Numeric bounds the grammar engine refuses: an integer's that are not whole or beyond 64 bits, and a range
    (exclusive ends included) that holds no value."""
    bounds = {k: node[k] for k in _NUMERIC if isinstance(node.get(k), int | float) and not isinstance(node[k], bool)}
    if not bounds:
        return None
    declared = node.get("type")
    types: list[Any] = declared if isinstance(declared, list) else [declared]
    integer = "integer" in types and "number" not in types
    if integer:
        for key, value in bounds.items():
            if not math.isfinite(value) or value != int(value):
                return f"an integer's {key} must be a whole number, not {value}"
            if not -(2**63) <= value < 2**63:
                return f"an integer's {key} ({value}) is beyond 64 bits"
    lows = [(bounds[k], k.startswith("exclusive")) for k in ("minimum", "exclusiveMinimum") if k in bounds]
    highs = [(bounds[k], k.startswith("exclusive")) for k in ("maximum", "exclusiveMaximum") if k in bounds]
    if not lows or not highs:
        return None
    a, a_open = max(lows)  # the stricter of equal bounds is the exclusive one
    b, b_open = min(highs, key=lambda h: (h[0], not h[1]))
    if integer:
        a, b = (a + 1 if a_open else a), (b - 1 if b_open else b)
        empty = a > b
    else:
        empty = a > b or (a == b and (a_open or b_open))
    return "the bounds leave no value" if empty else None


def _schema_problem(node: Any, root: dict[str, Any], constrains: bool = True) -> str | None:
    """What in a schema valid as JSON Schema the grammar engine cannot compile or would not enforce: a regex outside
    its dialect, a `$ref` to nothing, an empty `enum`, bounds that nothing satisfies, a keyword it ignores.
    jsonschema checks none of these. Walked schema by schema, so a property named like a keyword is just a name."""
    if not isinstance(node, dict):
        return None
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        try:
            found = regex_dialect.problem(pattern)
        except (re.error, OverflowError) as e:
            return f"the pattern {pattern!r} is not a valid regex ({e})"
        if found is not None:
            return f"the pattern {pattern!r} uses {found}, which the grammar engine does not support"
    ref = node.get("$ref")
    if isinstance(ref, str) and _resolve(ref, root) is None:
        return f"$ref {ref!r} points to nothing in the schema (only local references, #/..., are followed)"
    if isinstance(ref, str) and _ref_loop(node, root):
        return f"$ref {ref!r} leads through references back to itself without reaching a schema"
    if node.get("enum") == []:
        return "an empty enum allows no value"
    for low, high in _BOUNDS:
        a, b = node.get(low), node.get(high)
        if isinstance(a, int | float) and isinstance(b, int | float) and a > b:
            return f"{low} ({a}) is greater than {high} ({b})"
    if found := _range_problem(node):
        return found
    unenforced = [k for k in _UNENFORCED if k in node and not (k == "uniqueItems" and node[k] is False)]
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        unenforced.append("allOf with more than one schema")
    if unenforced and constrains:
        return f"the grammar engine cannot enforce {', '.join(unenforced)}"
    return next((p for p in (_schema_problem(v, root, constrains) for v in _subschemas(node)) if p), None)


def _ref_loop(node: dict[str, Any], root: dict[str, Any]) -> bool:
    """Whether following `$ref` from this node comes back to a node already passed: a schema that is only
    references to itself (`{"$ref": "#"}`), which describes no value."""
    seen: list[int] = []
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        if id(node) in seen:
            return True
        seen.append(id(node))
        node = _resolve(node["$ref"], root)
    return False


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    """The part of the schema a local `$ref` (a JSON pointer after '#') names; None if there is none."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for step in filter(None, ref[1:].split("/")):
        step = step.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    return node


def check_regex(pattern: str) -> None:
    """The regex must be one the worker's grammar engine compiles and reads as Python does, so a bad one is a 400
    here and never a failed (or wrongly constrained) job."""
    try:
        found = regex_dialect.problem(pattern)
    except (re.error, OverflowError) as e:
        raise BadRequest(f"Invalid regex in structured_outputs: {e}", "structured_outputs") from e
    except RecursionError as e:
        raise BadRequest("structured_outputs.regex is nested too deeply.", "structured_outputs") from e
    if found is not None:
        raise BadRequest(
            f"structured_outputs.regex uses {found}, which the grammar engine does not support.", "structured_outputs"
        )
