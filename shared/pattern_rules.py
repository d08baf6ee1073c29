"""Which `pattern`s the structured-answer decoder enforces exactly, decided without torch.

The grammar library (xgrammar 0.2.9) turns a pattern into grammar rules of its own and writes the
matched characters raw inside the JSON string. Probing it (tests/unit/test_schema_rules.py keeps the
cases) showed where that and Python's `re` (jsonschema's validator) part ways: a pattern that can match
`"`, `\\` or a control character writes JSON that does not parse; `.` and negated classes also let
through UTF-8 that is not valid text; `\\Z`, `\\b`, lookarounds, backreferences and inline flags are
dropped or read as literals; `\\s`, `\\S`, `\\W`, `\\D` disagree with Python's classes; characters past
the Basic Multilingual Plane and surrogates are mishandled. So a pattern is accepted only from a subset
both read the same way: literal printable characters and positive classes of them (ranges, `\\d`,
`\\w`), groups, alternation, quantifiers, and `^`/`$`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from re import _constants as sre  # type: ignore[attr-defined]  # the stdlib's own, typeshed has no stubs
from re import _parser as sre_parse  # type: ignore[attr-defined]  # Python's parser, as `re` reads it
from typing import Any

_UNICODE = sre.SRE_FLAG_UNICODE  # the default flag of a str pattern; any other flag is inline
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_CATEGORIES = {sre.CATEGORY_DIGIT, sre.CATEGORY_WORD}
_ANCHORS = {sre.AT_BEGINNING, sre.AT_END}
_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT}


def problem(pattern: str) -> str | None:
    """Why the decoder would not enforce this pattern exactly, or None."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        return f"not a regular expression: {exc}"
    if parsed.state.flags & ~_UNICODE:
        return "inline flags ((?i), (?s), ...) are not enforced by the decoder"
    return _items(list(parsed)) or _anchors(list(parsed))


def _anchors(items: list[tuple[Any, Any]]) -> str | None:
    """`^` where something could come before it, or `$` where something could come after it: the
    decoder drops anchors and writes a whole match of what is left, which such a pattern refuses
    (review: `(a+)+$(a+)+$`). At an edge (of the pattern, or of a branch or group at its edge:
    `^\\d+$|^none$`, `(^a)b`) a whole match satisfies them, so they are taken."""
    if _inner_anchor(items, lead=True, trail=True):
        return "^ and $ are enforced only at the start and end of the pattern (or of its alternatives)"
    return None


def _inner_anchor(items: list[tuple[Any, Any]], lead: bool, trail: bool) -> bool:
    last = len(items) - 1
    return any(_inner(op, value, lead and i == 0, trail and i == last) for i, (op, value) in enumerate(items))


def _inner(op: Any, value: Any, first: bool, last: bool) -> bool:
    """Whether this item is, or holds, an anchor off the edge (`first`/`last`: it is at one)."""
    if op is sre.AT:
        return not ((value is sre.AT_BEGINNING and first) or (value is sre.AT_END and last))
    if op is sre.SUBPATTERN:
        return _inner_anchor(list(value[3]), first, last)
    if op is sre.BRANCH:
        return any(_inner_anchor(list(branch), first, last) for branch in value[1])
    if op in _REPEATS:  # repeated, an anchor is off the edge on every turn but one
        return _inner_anchor(list(value[2]), lead=False, trail=False)
    return False


def shortest(pattern: str) -> int:
    """The fewest characters a match of this (accepted) pattern has: repeats multiply, nested too."""
    return int(sre_parse.parse(pattern).getwidth()[0])


def bounded_repeats(pattern: str) -> Iterator[tuple[int, int, int]]:
    """Each repeat of this (accepted) pattern with an upper bound (`{m,n}`, `?`), nested ones too, as
    (m, n, the fewest characters one repetition has). The grammar library spells such a repeat out
    once per count, which is what makes its compile slow (issue 36: quadratic in n)."""
    stack = list(sre_parse.parse(pattern))
    while stack:
        op, value = stack.pop()
        if op in _REPEATS:
            low, high, item = value
            if high is not sre.MAXREPEAT:
                yield int(low), int(high), int(item.getwidth()[0])
            stack.extend(item)
        elif op is sre.SUBPATTERN:
            stack.extend(value[3])
        elif op is sre.BRANCH:
            for branch in value[1]:
                stack.extend(branch)


def spelled_out(pattern: str) -> int:
    """How many characters and classes the pattern is once its bounded repeats are spelled out, as the
    grammar library does (nested repeats multiply): what a compile's cost grows with."""
    return _spelled(list(sre_parse.parse(pattern)))


def _spelled(items: list[tuple[Any, Any]]) -> int:
    total = 0
    for op, value in items:
        if op in _REPEATS:
            low, high, item = value
            total += (max(1, low) if high is sre.MAXREPEAT else high) * _spelled(list(item))
        elif op is sre.SUBPATTERN:
            total += _spelled(list(value[3]))
        elif op is sre.BRANCH:
            total += sum(_spelled(list(branch)) for branch in value[1])
        elif op is not sre.AT:  # a character or a class; anchors spell nothing
            total += 1
    return total


def _items(items: list[tuple[Any, Any]]) -> str | None:
    stack = list(items)
    while stack:
        op, value = stack.pop()
        found = _item(op, value, stack)
        if found:
            return found
    return None


def _item(op: Any, value: Any, stack: list[tuple[Any, Any]]) -> str | None:
    if op is sre.LITERAL:
        return _character(value)
    if op is sre.IN:
        return _class(value)
    if op is sre.AT:
        return None if value in _ANCHORS else "only ^ and $ are enforced as anchors (not \\A, \\Z, \\b, \\B)"
    if op in _REPEATS:
        stack.extend(value[2])
        return None
    if op is sre.SUBPATTERN:
        if value[1] or value[2]:
            return "inline flags ((?i:...), ...) are not enforced by the decoder"
        stack.extend(value[3])
        return None
    if op is sre.BRANCH:
        for branch in value[1]:
            stack.extend(branch)
        return None
    if op is sre.CATEGORY:
        return _category(value)
    return _refused(op)


def _refused(op: Any) -> str:
    named = {
        sre.ANY: "'.' (it matches \" and \\, which the decoder would write raw)",
        sre.NOT_LITERAL: 'a negated class [^...] (it matches " and \\)',
        sre.GROUPREF: "backreferences",
        sre.GROUPREF_EXISTS: "conditional groups",
        sre.ASSERT: "lookarounds",
        sre.ASSERT_NOT: "lookarounds",
    }
    return f"{named.get(op, str(op).lower())} cannot be enforced by the decoder in a pattern"


def _character(code: int) -> str | None:
    if code in (_QUOTE, _BACKSLASH):
        return f"a pattern matching {chr(code)!r} (the decoder would write it raw inside the JSON string)"
    if code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0:
        return f"a pattern matching the control character U+{code:04X}"
    if 0xD800 <= code <= 0xDFFF or code > 0xFFFF:
        return f"a pattern matching U+{code:04X} (surrogates and characters past U+FFFF are not enforced)"
    return None


def _class(items: list[tuple[Any, Any]]) -> str | None:
    for op, value in items:
        if op is sre.NEGATE:
            return _refused(sre.NOT_LITERAL)
        if op is sre.LITERAL:
            found = _character(value)
        elif op is sre.RANGE:
            found = _range(*value)
        elif op is sre.CATEGORY:
            found = _category(value)
        else:
            found = _refused(op)
        if found:
            return found
    return None


def _range(low: int, high: int) -> str | None:
    for code in (_QUOTE, _BACKSLASH):
        if low <= code <= high:
            return _character(code)
    for start, end in ((0, 0x1F), (0x7F, 0x9F), (0xD800, 0xDFFF), (0x10000, 0x10FFFF)):
        if low <= end and high >= start:
            return _character(max(low, start))
    return None


def _category(value: Any) -> str | None:
    if value in _CATEGORIES:
        return None
    return "only the classes \\d and \\w are enforced as Python reads them (not \\s, \\S, \\D, \\W)"
