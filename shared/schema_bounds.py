"""Bounds of a response_format against what the job's max_new_tokens can ever emit, checked without
torch at submission (and by the worker's first look at a message).

What is sound: every token of the model's vocabulary decodes to at most MRC_MAX_TOKEN_CHARS characters
(the worker checks its own vocabulary against the setting when it loads), so an answer of N tokens
holds at most N x MRC_MAX_TOKEN_CHARS characters: the reach. A token may emit many characters, so a
bound of more characters than max_new_tokens is not by itself out of reach; only one past the reach is.

- A lower bound (minLength, minItems, a pattern's `{m}`, required properties, the shortest enum value)
  whose answer needs more characters than the reach can never complete: the job could only end
  `answer_incomplete`. Nested bounds multiply (`(ab{50}){40}` needs 2,080).
- An upper bound (maxLength, maxItems, a pattern's `{m,n}`, an enum value or choice) that an answer
  of the reach's length cannot exceed, or reach, can never bind. It is refused rather than clamped:
  the caller learns at submission that schema and budget disagree, and the worker never spends a
  compile on it (the grammar library spells a pattern's `{m,n}` out once per count: `^[a-z]{1,20000}$`
  compiled in 51.6 s). `maxProperties`/`minProperties` are refused by name already (not enforced).

Every estimate here is of the fewest characters (a value's shortest JSON, no escapes, a cycle of
`$ref`s counted as nothing), so a refusal holds whatever the model writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shared import pattern_rules, schema_rules

# The decoder writes ", " between items and properties and ": " after a name (no free whitespace).
SEPARATOR = 2
COLON = 2
_BRACKETS = 2
_LITERALS = {"boolean": 4, "null": 4}  # true/false, null
_FORCING = {"string": "minLength", "array": "minItems", "object": "required"}


@dataclass(frozen=True)
class Reach:
    """The most characters an answer of `tokens` tokens can hold."""

    tokens: int
    token_chars: int

    @property
    def chars(self) -> int:
        return self.tokens * self.token_chars

    def __str__(self) -> str:
        return (
            f"no answer of max_new_tokens {self.tokens} holds more than {self.chars} characters "
            f"({self.tokens} tokens x MRC_MAX_TOKEN_CHARS {self.token_chars})"
        )


def choices_problem(choices: list[str], reach: Reach) -> str | None:
    """A choice longer than the reach can never be written out (greedy decoding may start it anyway)."""
    for index, choice in enumerate(choices):
        if len(choice) > reach.chars:
            return f"response_format.choices.{index}: the choice is {len(choice)} characters; {reach}"
    return None


def schema_problem(schema: dict[str, Any], reach: Reach) -> str | None:
    """The first bound of this (accepted) schema that max_new_tokens can never meet or reach, by place."""
    widths = _Widths(schema)
    found = _shortest_problem(widths, schema, "", reach, 0)
    if found:
        return found
    for node, where in schema_rules.nodes(schema, ""):
        found = _upper_problem(widths, node, "" if where == "/" else where, reach)
        if found:
            return found
    return None


def costliest(schema: dict[str, Any]) -> str:
    """The place of the pattern the grammar library spells out longest (what a slow compile is made
    of), with its size; the schema itself when it has no pattern."""
    best, place = 0, "response_format.schema"
    for node, where in schema_rules.nodes(schema, ""):
        pattern = node.get("pattern")
        size = pattern_rules.spelled_out(pattern) if isinstance(pattern, str) else 0
        if size > best:
            best, place = size, f"{_place('' if where == '/' else where, 'pattern')} ({size} spelled out)"
    return place


def spelled_out_total(schema: dict[str, Any]) -> int:
    """Every pattern of the schema spelled out, summed: what a compile's time grows with (roughly as
    its square; the library keeps maxLength and maxItems as repeats, cheap whatever their size)."""
    return sum(
        pattern_rules.spelled_out(node["pattern"])
        for node, _where in schema_rules.nodes(schema, "")
        if isinstance(node.get("pattern"), str)
    )


def _place(where: str, key: str = "") -> str:
    """`/properties/note` and `pattern` -> `response_format.schema.properties.note.pattern`."""
    parts = [p for p in where.split("/") if p] + ([key] if key else [])
    return ".".join(["response_format.schema", *parts])


def _dump(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False))


# ------------------------------------------------------------------ the fewest characters
class _Widths:
    """The fewest characters an answer of each subschema has (memoised per subschema)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self._known: dict[int, int] = {}

    def of(self, node: object, refs: frozenset[str] = frozenset()) -> int:
        if not isinstance(node, dict):
            return 1 if node is True else 0  # true: any value ("0"); false allows none (counted 0)
        if id(node) not in self._known:
            self._known[id(node)] = self._measure(node, refs)
        return self._known[id(node)]

    def _measure(self, node: dict[str, Any], refs: frozenset[str]) -> int:
        ref = node.get("$ref")
        if isinstance(ref, str):  # a cycle counts as nothing: an estimate below any real answer
            target = schema_rules.resolve(self.root, ref)
            return 0 if ref in refs or target is schema_rules.NOWHERE else self.of(target, refs | {ref})
        if "enum" in node:
            return min((_dump(v) for v in node["enum"]), default=0)
        if "const" in node:
            return _dump(node["const"])
        if isinstance(node.get("anyOf"), list):
            return min((self.of(branch, refs) for branch in node["anyOf"]), default=0)
        declared = node.get("type")
        types = [declared] if isinstance(declared, str) else list(declared or ())
        return min((self._typed(node, kind, refs) for kind in types), default=1)

    def _typed(self, node: dict[str, Any], kind: str, refs: frozenset[str]) -> int:
        if kind == "string":
            pattern = node.get("pattern")
            inner = pattern_rules.shortest(pattern) if isinstance(pattern, str) else node.get("minLength", 0)
            return 2 + int(inner)
        if kind == "array":  # the minItems items (never listed one by one: minItems may be 10**9)
            count, prefix = int(node.get("minItems", 0)), node.get("prefixItems", [])
            listed = sum(self.of(item, refs) for item in prefix[:count])
            rest = max(0, count - len(prefix)) * self.of(node.get("items", True), refs)
            return _BRACKETS + listed + rest + SEPARATOR * max(0, count - 1)
        if kind == "object":
            properties = node.get("properties", {})
            names = node.get("required", [])
            pairs = [_dump(name) + COLON + self.of(properties.get(name), refs) for name in names]
            return _BRACKETS + sum(pairs) + SEPARATOR * max(0, len(names) - 1)
        return _LITERALS.get(kind, 1)  # a number or integer: one digit

    @staticmethod
    def forced_items(node: dict[str, Any], count: int) -> list[object]:
        prefix = node.get("prefixItems", [])
        return [prefix[i] if i < len(prefix) else node.get("items", True) for i in range(count)]


def _shortest_problem(widths: _Widths, node: object, where: str, reach: Reach, depth: int) -> str | None:
    """Where the shortest answer is past the reach: the innermost forced part that is past it alone."""
    need = widths.of(node)
    if need <= reach.chars or not isinstance(node, dict):
        return None
    for child, child_where in _forced(widths, node, where):
        if widths.of(child) > reach.chars and depth < 64:
            return _shortest_problem(widths, child, child_where, reach, depth + 1)
    key = _forcing_key(node)
    return f"{_place(where, key)}: an answer here is at least {need} characters; {reach}"


def _forcing_key(node: dict[str, Any]) -> str:
    """The keyword that makes this node's answers long (the place a refusal names)."""
    for key in ("enum", "const"):
        if key in node:
            return key
    kind = node.get("type")
    if kind == "string" and "pattern" in node:
        return "pattern"
    return _FORCING.get(kind, "") if isinstance(kind, str) else ""


def _forced(widths: _Widths, node: dict[str, Any], where: str) -> Iterator[tuple[object, str]]:
    """The parts every answer of this node holds (the first branch of an anyOf: all are past it)."""
    ref = node.get("$ref")
    if isinstance(ref, str):
        yield schema_rules.resolve(widths.root, ref), "/" + ref.removeprefix("#").strip("/")
        return
    if isinstance(node.get("anyOf"), list) and node["anyOf"]:
        yield node["anyOf"][0], f"{where}/anyOf/0"
        return
    for name in node.get("required", []):
        yield node.get("properties", {}).get(name), f"{where}/properties/{name}"
    prefix = node.get("prefixItems", [])
    for index, item in enumerate(_Widths.forced_items(node, min(node.get("minItems", 0), len(prefix) + 1))):
        yield item, f"{where}/prefixItems/{index}" if index < len(prefix) else f"{where}/items"


# ------------------------------------------------------------------ bounds that can never bind
def _upper_problem(widths: _Widths, node: dict[str, Any], where: str, reach: Reach) -> str | None:
    never = f"can never bind: an answer past it is at least {{}} characters; {reach}"
    limit = node.get("maxLength")
    if isinstance(limit, int) and "string" in _types(node) and limit + 3 > reach.chars:
        return f"{_place(where, 'maxLength')}: maxLength {limit} " + never.format(limit + 3)
    limit = node.get("maxItems")
    if isinstance(limit, int) and "array" in _types(node):
        item = max(1, min(widths.of(i) for i in [*node.get("prefixItems", []), node.get("items", True)]))
        past = _BRACKETS + (limit + 1) * item + SEPARATOR * limit
        if past > reach.chars:
            return f"{_place(where, 'maxItems')}: maxItems {limit} " + never.format(past)
    pattern = node.get("pattern")
    for low, high, item in pattern_rules.bounded_repeats(pattern) if isinstance(pattern, str) else ():
        past = (high + 1) * max(1, item) + 2
        if past > reach.chars:
            repeat = f"{{{high}}}" if low == high else f"{{{low},{high}}}"
            return f"{_place(where, 'pattern')}: its repeat {repeat} " + never.format(past)
    for index, value in enumerate(node.get("enum", []) if isinstance(node.get("enum"), list) else []):
        if _dump(value) > reach.chars:
            return f"{_place(where, f'enum.{index}')}: the value is {_dump(value)} characters; {reach}"
    return None


def _types(node: dict[str, Any]) -> set[str]:
    declared = node.get("type")
    return {declared} if isinstance(declared, str) else set(declared or ())
