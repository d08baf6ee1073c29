"""The bounded matcher answers as `re.search` does on the patterns the decoder enforces, and answers
the patterns `re` takes exponential time on (review: one tenant's `(a+)+$...` froze a worker)."""

from __future__ import annotations

import json
import random
import re

import pytest

from shared import pattern_match, pattern_rules
from shared import response_format as rf

_ATOMS = ["a", "b", "1", "[ab]", r"\d", r"\w", "[a-b1_]", "x", "é", "[٠-٩]"]


def _pattern(rng: random.Random, depth: int = 0) -> str:
    roll = rng.random()
    if depth > 3 or roll < 0.3:
        return rng.choice(_ATOMS)
    if roll < 0.45:
        return _pattern(rng, depth + 1) + _pattern(rng, depth + 1)
    if roll < 0.6:
        return f"({_pattern(rng, depth + 1)}|{_pattern(rng, depth + 1)})"
    if roll < 0.8:
        repeat = rng.choice(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "*?", "+?", "{2,}"])
        return f"({_pattern(rng, depth + 1)}){repeat}"
    return rng.choice(["^", ""]) + _pattern(rng, depth + 1) + rng.choice(["$", ""])


def test_it_answers_as_re_search_does_on_drawn_patterns_and_texts() -> None:
    rng = random.Random(7)
    checked = 0
    while checked < 6000:
        pattern = _pattern(rng)
        if pattern_rules.problem(pattern):
            continue
        for _ in range(6):
            text = "".join(rng.choice("ab1_xé٣\n") for _ in range(rng.randint(0, 9)))
            assert pattern_match.search(pattern, text) == (re.search(pattern, text) is not None), (
                pattern,
                text,
            )
            checked += 1


@pytest.mark.parametrize(
    ("pattern", "text"),
    [("^(a+)+$", "a" * 60 + "!"), ("(a|aa)+b", "a" * 80), ("^(\\w+\\d?)+$", "a1" * 40 + "-")],
)
def test_what_re_backtracks_on_for_ever_is_answered(pattern: str, text: str) -> None:
    assert not pattern_match.search(pattern, text)  # re.search: 2^60 steps and more
    fmt = rf.parse({"type": "json_schema", "schema": {"type": "string", "pattern": pattern}})
    assert fmt is not None
    with pytest.raises(ValueError, match="does not validate"):
        rf.read_output(fmt, f'"{text}"')  # the worker's last guard on an answer
    assert rf.read_output(fmt, '"a1"' if "d" in pattern else '"aab"' if "b" in pattern else '"aa"')


def test_a_pattern_past_its_size_is_refused_not_spelled_out() -> None:
    with pytest.raises(pattern_match.PatternTooCostly):
        pattern_match.search("((a{0,100}){0,100}){0,100}", "a")


def test_a_valid_answer_is_never_failed_for_the_cost_of_its_check() -> None:
    """Review: a 1,900-character answer to `[a-z ]{1,2000}$` failed `internal_error` (the check ran past
    its budget), and a pattern spelling out past the state cap failed every answer, built again each
    time. Past the budget the worker takes the decoder's word (it enforces accepted patterns exactly);
    the intake's check of listed values refuses instead."""
    long_fmt = rf.parse({"type": "json_schema", "schema": {"type": "string", "pattern": "[a-z ]{1,2000}$"}})
    text = ("ab " * 700)[:1900]
    assert rf.read_output(long_fmt, json.dumps(text)) == text
    big = r"^(([a-z]{1,10} ){0,50}\. ){0,200}$"
    big_fmt = rf.parse({"type": "json_schema", "schema": {"type": "string", "pattern": big}})
    assert rf.read_output(big_fmt, '"abc . "') == "abc . "
    with pytest.raises(pattern_match.PatternTooCostly):
        pattern_match.search(big, "abc . ")
