"""Values a structured answer must carry that the decoder cannot write as given, found by probing it
(tests/unit/test_schema_rules.py keeps the cases); checked without torch, at submission.

- numbers: the grammar library writes integer bounds through 64-bit integers and number bounds
  through doubles with limited digits, so an integer bound past int64, or a number (bound, `const`,
  `enum` value) past 2^53 or nearer zero than 1e-6, comes out wrong or allows an empty answer;
- text: the model's control tokens (end-of-text, `|SPEAKER|`...) written as text in a choice or a
  listed string are produced as the token itself, which ends or corrupts the answer;
- choices are written without quotes, and the tokenizer drops the space before the first word when it
  decodes, so a choice with leading or trailing whitespace (or only whitespace) cannot come back as
  itself.
"""

from __future__ import annotations

import math
from typing import Any

from shared.prompts import FUYU_CONTROL_TEXT

INT64 = 2**63 - 1
EXACT = 2**53  # the largest integer a double holds exactly
SMALLEST = 1e-6
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def node_problem(node: dict[str, Any], where: str) -> str | None:
    """Why a value in this schema node cannot be written as given, or None."""
    declared = node.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or ())
    integer_only = "integer" in types and "number" not in types
    for key in _BOUNDS:
        value: Any = node.get(key)
        found = _bound(value, integer_only) if _is_number(value) else None
        if found:
            return f"at {where.rstrip('/')}/{key}: {found}"
    listed = node["enum"] if isinstance(node.get("enum"), list) else []
    if "const" in node:
        listed = [node["const"]]
    for value in listed:
        found = value_problem(value)
        if found:
            return f"at {where.rstrip('/')}/{'enum' if 'enum' in node else 'const'}: {found}"
    return None


def value_problem(value: Any) -> str | None:
    """Why a listed value (enum, const: any JSON) cannot be written as given, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = text_problem(item)
        elif _is_number(item):
            found = _number(item)
        else:
            found = None
            stack.extend(item.values() if isinstance(item, dict) else item if isinstance(item, list) else [])
        if found:
            return found
    return None


def text_problem(text: str) -> str | None:
    """Text of the model's own control tokens, written into an answer, becomes the token itself."""
    control = next((c for c in FUYU_CONTROL_TEXT if c and c in text), None)
    if control:
        return f"{text[:40]!r} holds {control!r}, a control token of the model: it cannot be written as text"
    return None


def choice_problem(choice: str) -> str | None:
    if choice != choice.strip():
        return f"{choice[:40]!r} starts or ends with whitespace, which the answer cannot keep"
    return text_problem(choice)


def _bound(value: float, integer_only: bool) -> str | None:
    if integer_only:
        if abs(value) > INT64:
            return f"an integer's bound must lie within +-{INT64} (64 bits), got {value}"
        return None
    return _number(value)


def _number(value: float) -> str | None:
    if not math.isfinite(value) or abs(value) > EXACT:
        return f"{value} is beyond +-2^53, where the decoder writes numbers inexactly"
    if value != 0 and abs(value) < SMALLEST:
        return f"{value} is nearer zero than {SMALLEST}, where the decoder writes numbers inexactly"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
