"""`re.search(pattern, text)` for the patterns the decoder enforces (shared/pattern_rules.py), in time
bounded by the text's length times the pattern's size: a set of automaton states per position, never
backtracking.

A caller's `pattern` is checked against text twice: by the worker, against each structured answer (a
last guard: jsonschema's `pattern` keyword), and by the intake, against `enum`/`const` values beside
it. Python's `re` backtracks, and a pattern such as `(a+)+$` takes time exponential in the text it
fails on, holding the interpreter lock: one tenant's request froze a worker for every tenant (review).
This reads the pattern as `re` does (its own parser) and answers the same for the accepted subset:
literals, positive classes (ranges, `\\d`, `\\w`), groups, alternation, repeats, `^` and `$`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from re import _constants as sre  # type: ignore[attr-defined]  # the stdlib's own, typeshed has no stubs
from re import _parser as sre_parse  # type: ignore[attr-defined]  # Python's parser, as `re` reads it
from typing import Any

import jsonschema

MAX_STATES = 10_000  # a pattern that spells out to more (nested bounded repeats) is not checked
MAX_WORK = 300_000  # states visited in one check (~0.2 s of Python); past it, PatternTooCostly


class PatternTooCostly(ValueError):
    """The pattern is too large, or the text too long for it, to check within the budget."""


class PatternNotSupported(ValueError):
    """A construct outside the subset the decoder enforces (pattern_rules.problem refuses it)."""


def validator(schema: dict[str, Any], *, trust_costly: bool = False) -> Any:
    """A jsonschema validator for `schema` whose `pattern` keyword matches with `search`. A check past
    the budget raises PatternTooCostly, or with `trust_costly` passes: the worker's last look at an
    answer the decoder made (it enforces an accepted pattern exactly: pattern_rules), which must not
    fail a valid answer for its length (review: `[a-z ]{1,2000}$` over 1,900 characters)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return _bounded(cls, trust_costly)(schema)


@functools.cache
def _bounded(cls: Any, trust_costly: bool) -> Any:
    return jsonschema.validators.extend(cls, {"pattern": functools.partial(_pattern_keyword, trust_costly)})


def _pattern_keyword(trust_costly: bool, validator: Any, pattern: Any, instance: Any, schema: Any) -> Any:
    if not (validator.is_type(instance, "string") and isinstance(pattern, str)):
        return
    try:
        found = search(pattern, instance)
    except PatternTooCostly:
        if trust_costly:
            return
        raise
    if not found:
        yield jsonschema.ValidationError(f"{instance[:60]!r} does not match {pattern[:60]!r}")


@dataclass
class _State:
    test: Callable[[str], bool] | None = None  # a character state: what it takes, then `out`
    anchor: Any = None  # sre.AT_BEGINNING or sre.AT_END: an assertion, then `out`
    out: list[_State] = field(default_factory=list)  # where it goes (several: a choice)
    final: bool = False


def search(pattern: str, text: str, max_work: int = MAX_WORK) -> bool:
    """Whether `re.search(pattern, text)` finds a match. Raises PatternTooCostly past `max_work`
    states visited, or for a pattern past MAX_STATES (decided once per pattern)."""
    start = _compile(pattern)
    if start is None:
        raise PatternTooCostly(f"the pattern spells out to more than {MAX_STATES} states")
    work = [max_work]
    current: dict[int, _State] = {}
    for pos in range(len(text) + 1):
        current, found = _closure([start, *current.values()], text, pos, work)
        if found:
            return True
        if pos == len(text):
            return False
        char = text[pos]
        moved = [nxt for s in current.values() if s.test is not None and s.test(char) for nxt in s.out]
        current = {id(s): s for s in moved}
    return False


def _closure(seeds: list[_State], text: str, pos: int, work: list[int]) -> tuple[dict[int, _State], bool]:
    """The character states reachable from `seeds` without taking a character at `pos`."""
    seen: dict[int, _State] = {}
    stack = list(seeds)
    found = False
    while stack:
        state = stack.pop()
        if id(state) in seen:
            continue
        seen[id(state)] = state
        work[0] -= 1
        if work[0] < 0:
            raise PatternTooCostly(f"checking the pattern took over {MAX_WORK} steps")
        if state.final:
            found = True
        elif state.test is None and (state.anchor is None or _holds(state.anchor, text, pos)):
            stack.extend(state.out)
    return {k: s for k, s in seen.items() if s.test is not None}, found


def _holds(anchor: Any, text: str, pos: int) -> bool:
    if anchor is sre.AT_BEGINNING:
        return pos == 0
    # `$` as `re` reads it: at the end, or before a newline that ends the text
    return pos == len(text) or (pos == len(text) - 1 and text[-1] == "\n")


@functools.lru_cache(maxsize=256)
def _compile(pattern: str) -> _State | None:
    """The pattern's automaton, or None past MAX_STATES (cached too: review, a refused compile was
    built again, seconds of it, at every answer)."""
    budget = [MAX_STATES]
    try:
        return _sequence(list(sre_parse.parse(pattern)), _State(final=True), budget)
    except PatternTooCostly:
        return None


def _new(budget: list[int], **fields: Any) -> _State:
    budget[0] -= 1
    if budget[0] < 0:
        raise PatternTooCostly(f"the pattern spells out to more than {MAX_STATES} states")
    return _State(**fields)


def _sequence(items: list[tuple[Any, Any]], then: _State, budget: list[int]) -> _State:
    for op, value in reversed(items):
        then = _item(op, value, then, budget)
    return then


def _item(op: Any, value: Any, then: _State, budget: list[int]) -> _State:
    if op is sre.LITERAL:
        return _new(budget, test=functools.partial(_is, chr(value)), out=[then])
    if op is sre.IN:
        return _new(budget, test=_class(value), out=[then])
    if op is sre.AT and value in (sre.AT_BEGINNING, sre.AT_END):
        return _new(budget, anchor=value, out=[then])
    if op is sre.SUBPATTERN and not value[1] and not value[2]:
        return _sequence(list(value[3]), then, budget)
    if op is sre.BRANCH:
        return _new(budget, out=[_sequence(list(b), then, budget) for b in value[1]])
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # greedy or lazy: the same matches exist
        low, high, items = value
        return _repeat(low, high, items, then, budget)
    raise PatternNotSupported(f"{op} is not in the subset the decoder enforces")


def _repeat(low: int, high: Any, items: Any, then: _State, budget: list[int]) -> _State:
    if high is sre.MAXREPEAT:
        loop = _new(budget)
        loop.out = [_sequence(list(items), loop, budget), then]
        tail = loop
    else:
        tail = then
        for _ in range(int(high) - int(low)):  # each optional copy leads to the next or out
            tail = _new(budget, out=[_sequence(list(items), tail, budget), then])
    for _ in range(int(low)):
        tail = _sequence(list(items), tail, budget)
    return tail


def _is(wanted: str, char: str) -> bool:
    return char == wanted


def _class(items: list[tuple[Any, Any]]) -> Callable[[str], bool]:
    literals = {chr(v) for op, v in items if op is sre.LITERAL}
    ranges = [(int(lo), int(hi)) for op, (lo, hi) in ((o, v) for o, v in items if o is sre.RANGE)]
    categories = [v for op, v in items if op is sre.CATEGORY]
    for op, _value in items:
        if op not in (sre.LITERAL, sre.RANGE, sre.CATEGORY):
            raise PatternNotSupported(f"{op} in a class is not in the subset the decoder enforces")
    for category in categories:
        if category not in (sre.CATEGORY_DIGIT, sre.CATEGORY_WORD):
            raise PatternNotSupported(f"{category} is not in the subset the decoder enforces")

    def test(char: str) -> bool:
        code = ord(char)
        return (
            char in literals
            or any(lo <= code <= hi for lo, hi in ranges)
            or any(_category(c, char) for c in categories)
        )

    return test


def _category(category: Any, char: str) -> bool:
    # As `re` reads a str pattern: \d any Unicode decimal digit, \w alphanumerics and the underscore.
    if category is sre.CATEGORY_DIGIT:
        return char.isdecimal()
    return char.isalnum() or char == "_"
