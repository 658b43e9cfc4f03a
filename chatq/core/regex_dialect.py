"""Which regexes the grammar engine reads as Python does.

xgrammar (the worker's grammar engine) compiles a narrower regex dialect than Python's (no lookarounds, named
groups, inline flags, word boundaries, ...) and reads some of it otherwise (`\\A` as the letter A). The API must
refuse those but cannot load xgrammar (it imports torch), and no library checks its dialect: Python's own parser
finds most, a scan of the text the rest.
"""

from __future__ import annotations

import re
from re import _constants as c  # type: ignore[attr-defined]  # private, and so not in typeshed
from re import _parser  # type: ignore[attr-defined]
from typing import Any


def problem(pattern: str) -> str | None:
    """What in the pattern xgrammar's dialect lacks or reads otherwise, in words, or None. Raises re.error (and
    OverflowError or RecursionError) for a pattern Python itself refuses."""
    parsed = _parser.parse(pattern)
    refused = {
        c.ASSERT: "lookarounds",
        c.ASSERT_NOT: "lookarounds",
        c.GROUPREF: "backreferences",
        c.GROUPREF_EXISTS: "conditional groups",
        c.POSSESSIVE_REPEAT: "possessive repeats",
        c.POSSESSIVE_REPEAT_ONE: "possessive repeats",
        c.ATOMIC_GROUP: "atomic groups",
    }
    anchors = {
        c.AT_BOUNDARY: "word boundaries (\\b, \\B)",
        c.AT_NON_BOUNDARY: "word boundaries (\\b, \\B)",
        c.AT_BEGINNING_STRING: "string anchors (\\A, \\Z)",
        c.AT_END_STRING: "string anchors (\\A, \\Z)",
    }

    def problem(node: Any) -> str | None:
        for op, arg in node:
            if op in refused:
                return refused[op]
            if op is c.AT and arg in anchors:
                return anchors[arg]
            if op is c.SUBPATTERN and (arg[1] or arg[2]):
                return "inline flags"
            for sub in arg if isinstance(arg, (list, tuple)) else ():
                if isinstance(sub, _parser.SubPattern) and (found := problem(sub)):
                    return found
                for branch in sub if isinstance(sub, list) else ():
                    if isinstance(branch, _parser.SubPattern) and (found := problem(branch)):
                        return found
        return None

    if found := problem(parsed):
        return found
    if (count := _repetitions(parsed)) > MAX_REPETITIONS:
        return f"counted repeats nested to {count} repetitions (at most {MAX_REPETITIONS})"
    if parsed.state.groupdict:
        return "named groups"
    # Global flags can only open a pattern, and (?u) changes nothing Python's parser would show.
    if parsed.state.flags & ~re.UNICODE or re.match(r"\(\?[aiLmsux]+\)", pattern):
        return "inline flags"
    return _text_problem(pattern)


# Nested counted repeats multiply the grammar engine's states: past this product, filling one sequence's token mask
# takes long enough to hold up the step of every stream in the batch.
MAX_REPETITIONS = 10_000


def _repetitions(node: Any) -> int:
    """The largest product of the counts of nested repeats (`{m,n}` counts n; `*` and `+` their minimum)."""
    most = 1
    for op, arg in node:
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):
            low, high, sub = arg
            most = max(most, max(low if high == c.MAXREPEAT else high, 1) * _repetitions(sub))
            continue
        for sub in arg if isinstance(arg, (list, tuple)) else ():
            if isinstance(sub, _parser.SubPattern):
                most = max(most, _repetitions(sub))
            for branch in sub if isinstance(sub, list) else ():
                if isinstance(branch, _parser.SubPattern):
                    most = max(most, _repetitions(branch))
    return most


# Python has refused backreferences before these are looked for: what is left of `\\nnn` is an octal escape.
_OCTAL = re.compile(r"\\(0[0-7]|[1-9])")


def _escape_problem(pattern: str, i: int) -> str | None:
    """An escape at `i` that Python's parser reads otherwise than xgrammar, in a class or out of one."""
    if pattern.startswith("\\N{", i):
        return "named characters (\\N{...})"
    if _OCTAL.match(pattern, i):
        return "octal escapes (\\0nn, \\nnn)"
    return None


def _text_problem(pattern: str) -> str | None:
    """What Python's parser leaves no trace of: comments, `{,n}` (read as `{0,n}`), named characters, octal escapes
    (xgrammar reads `\\101` as a backreference), and a class opening with `]`."""
    i, n = 0, len(pattern)
    while i < n:
        if found := _escape_problem(pattern, i):
            return found
        if pattern[i] == "\\":
            i += 2
        elif pattern[i] == "[":
            i += 1
            i += pattern.startswith("^", i)
            if pattern.startswith("]", i):  # a member to Python, an error to xgrammar; `\]` is a member to both
                return "an unescaped ] first in a class"
            while i < n and pattern[i] != "]":
                if found := _escape_problem(pattern, i):
                    return found
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif pattern.startswith("(?#", i):
            return "comments"
        elif pattern.startswith("{,", i):
            return "repeats with no lower bound ({,n})"
        else:
            i += 1
    return None
