"""What the decoder enforces of a JSON Schema: each keyword combination it would drop, each schema it
cannot compile and each that has no answer is refused at submission; every schema accepted has only
valid answers — checked by drawing schemas beyond the plain subset and walking their grammars at
random (tiny Fuyu's vocabulary; no model call: a walk picks among the tokens the mask allows)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import encoding
from shared import response_format as rf
from shared.errors import InvalidJob
from shared.jobs import Job
from shared.settings import Settings
from tests.support import schema_draws
from workers.backends.fuyu import FuyuBackend
from workers.engine.sequence import DEAD_END, Sequence

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
MESSAGE = {"job_id": "j1", "image_uri": "s3://mrc/a.jpg", "prompt": "Refund?", "max_new_tokens": 8}
STRING = {"type": "string"}


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    loaded = FuyuBackend(Settings(model="tiny", home=HOME, quantization="fp32", device="cpu"))
    loaded.load()
    return loaded


def _schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "schema": schema}


# Each was accepted before and its keyword silently dropped by the grammar (probed: the grammar took a
# string that breaks it), or it compiled to nothing, or it has no answer at all.
@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "'maxLength' beside 'pattern'"),
        ({"type": "string", "pattern": "^a+$", "minLength": 3}, "'minLength' beside 'pattern'"),
        ({"$defs": {"s": STRING}, "$ref": "#/$defs/s", "maxLength": 2}, "'maxLength' beside '$ref'"),
        ({"$defs": {"s": STRING}, "$ref": "#/$defs/s", "type": "string"}, "'type' beside '$ref'"),
        ({"anyOf": [STRING, {"type": "integer"}], "maxLength": 2}, "'maxLength' beside 'anyOf'"),
        ({"type": "object", "anyOf": [{"type": "object"}], "required": []}, "beside 'anyOf'"),
        ({"enum": ["a", "bbbb"], "maxLength": 2}, "'bbbb' breaks 'maxLength'"),
        ({"type": "string", "enum": ["a", 1]}, "the value 1 breaks 'type'"),
        ({"type": "string", "const": 1}, "the value 1 breaks 'type'"),
        ({"const": 1, "minimum": 5}, "breaks 'minimum'"),
        ({"enum": ["a"], "const": "a"}, "either enum or const"),
        ({"enum": []}, "empty enum"),
        ({"maxLength": 2}, "'maxLength' is enforced only beside a 'type'"),
        ({"minimum": 5}, "'minimum' is enforced only beside a 'type'"),
        ({"exclusiveMinimum": 0}, "'exclusiveMinimum' is enforced only beside a 'type'"),
        ({"maxItems": 1}, "'maxItems' is enforced only beside a 'type'"),
        ({"pattern": "^a$"}, "'pattern' is enforced only beside a 'type'"),
        ({"type": "integer", "minimum": 1.5}, "whole number"),
        ({"type": "integer", "exclusiveMinimum": 0.5}, "whole number"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "no answer fits"),
        ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "leave no value"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "leave no value"),
        ({"type": "string", "minLength": 3, "maxLength": 1}, "no answer fits"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "no answer fits"),
        ({"type": "array", "prefixItems": [STRING, STRING], "maxItems": 1}, "below the 2 prefixItems"),
        ({"type": "array", "prefixItems": [STRING], "minItems": 2}, "past the 1 prefixItems"),
        ({"type": "array", "prefixItems": [STRING], "items": False, "minItems": 2}, "past the 1 prefixItems"),
        ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, "no finite answer"),
        ({"$ref": "#/$defs/missing"}, "points at nothing"),
        # Review, helper-90: an index in Unicode digits passed, and the worker's grammar failed the job;
        # "²" and 5,000 digits were refused in int()'s own words.
        (
            {"$defs": {"a": {"anyOf": [STRING, STRING]}}, "$ref": "#/$defs/a/anyOf/\u0661"},
            "points at nothing",
        ),
        (
            {"$defs": {"a": {"anyOf": [STRING, STRING]}}, "$ref": "#/$defs/a/anyOf/\u00b2"},
            "points at nothing",
        ),
        ({"$defs": {"a": {"anyOf": [STRING, STRING]}}, "$ref": "#/$defs/a/anyOf/01"}, "points at nothing"),
        (
            {"$defs": {"a": {"anyOf": [STRING, STRING]}}, "$ref": "#/$defs/a/anyOf/" + "1" * 5000},
            "points at nothing",
        ),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "'false' allows nothing"),
        ({"type": "array", "items": False, "minItems": 1}, "no finite answer"),
        # Patterns the grammar writes raw, drops, or reads unlike Python's re (found by random walks):
        ({"type": "string", "pattern": '^"$'}, "matching '\"'"),
        ({"type": "string", "pattern": "^[\\\\]$"}, "matching '\\\\'"),
        ({"type": "string", "pattern": "^\n$"}, "control character U+000A"),
        ({"type": "string", "pattern": "^a.b$"}, "'.'"),
        ({"type": "string", "pattern": "^[^a]$"}, "negated class"),
        ({"type": "string", "pattern": "[^\\s\\S]"}, "negated class"),
        ({"type": "string", "pattern": "(?i)^abc$"}, "inline flags"),
        ({"type": "string", "pattern": "^(a)\\1$"}, "backreferences"),
        ({"type": "string", "pattern": "^(?!a)[a-c]$"}, "lookarounds"),
        ({"type": "string", "pattern": "^a\\Z"}, "only ^ and $"),
        # The decoder drops an anchor inside: review, `(a+)+$(a+)+$` let it write what `re` refuses
        # (and took `re` exponential time to refuse, the worker frozen).
        ({"type": "string", "pattern": "(a+)+$(a+)+$"}, "only at the start and end"),
        ({"type": "string", "pattern": "^(a$)b"}, "only at the start and end"),
        ({"type": "string", "pattern": "(^a)+"}, "only at the start and end"),
        # An enum value checked against a pattern beside it: in bounded time (re backtracks: forever).
        ({"type": "string", "enum": ["a" * 40 + "!"], "pattern": "^(a+)+$"}, "breaks 'pattern'"),
        ({"type": "string", "pattern": "^\\s$"}, "only the classes \\d and \\w"),
        ({"type": "string", "pattern": "^[\\U00010000-\\U0010ffff]$"}, "past U+FFFF"),
        ({"type": "string", "pattern": "\\ud800"}, "surrogates"),
        ({"type": "object", "properties": {"a": False}}, "'false' allows nothing"),
        ({"type": "array", "prefixItems": [False]}, "'false' allows nothing"),
        ({"anyOf": [False, {"type": "null"}]}, "'false' allows nothing"),
        ({"type": "integer", "minimum": 1e20}, "64 bits"),
        ({"type": "integer", "maximum": 2**63}, "64 bits"),
        ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-300}, "nearer zero"),
        ({"const": 12345678901234567890123456789}, "beyond +-2^53"),
        ({"enum": ["ok", "stop |ENDOFTEXT| here"]}, "control token of the model"),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}],
            },
            "comes back to itself",
        ),
    ],
)
def test_what_the_grammar_would_drop_or_cannot_compile_is_refused_by_name(schema: Any, reason: str) -> None:
    with pytest.raises(ValueError, match="response_format") as refused:
        rf.parse(_schema(schema))
    assert reason in str(refused.value), refused.value
    with pytest.raises(InvalidJob):
        Job.from_message({**MESSAGE, "response_format": _schema(schema)})


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^[a-z]{1,5}$"},
        {"type": "string", "enum": ["a", "b"], "title": "kept"},
        {"const": "refund", "type": "string", "description": "a note"},
        {"$defs": {"s": STRING}, "$ref": "#/$defs/s", "title": "a reference with annotations"},
        {"$defs": {"i": {"type": "integer"}}, "anyOf": [{"$ref": "#/$defs/i"}, {"type": "null"}]},
        {"type": ["string", "null"], "maxLength": 3},
        {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5},
        {"type": "array", "prefixItems": [STRING], "items": {"type": "integer"}, "minItems": 3},
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "string", "pattern": "^[\\w-]{1,8}$"},
        # Anchors at the edge of an alternative or a leading group: a whole match satisfies them (review).
        {"type": "string", "pattern": "^\\d+$|^none$"},
        {"type": "string", "pattern": "(^a)b|c$"},
        {"type": "string", "pattern": "^\u00e9[0-9]{2}$"},
        {"type": "object", "properties": {'"': {"const": "\u0001\\"}}, "required": ['"']},
        {"type": "number", "minimum": 0.5, "maximum": 2**53},
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                    "required": ["c"],
                }
            },
            "$ref": "#/$defs/n",
        },
    ],
)
def test_combinations_the_grammar_enforces_are_accepted(schema: Any) -> None:
    assert rf.parse(_schema(schema)) is not None


def test_limits_come_before_the_schema_is_walked() -> None:
    """A large schema is refused for its size whatever it holds (the walk is what costs)."""
    # 900 patterns that do not even compile: the size is what is refused, before any is looked at
    bad = {f"p{i}": {"type": "string", "pattern": "(a"} for i in range(900)}
    many = {"type": "object", "properties": bad}
    with pytest.raises(ValueError, match="the limit is 16384"):
        rf.parse(_schema(many), 16384)
    deep: Any = {"type": "string"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested more than 64"):
        rf.parse(_schema(deep))
    with pytest.raises(InvalidJob, match="nested more than 64"):
        Job.from_message({**MESSAGE, "response_format": _schema(deep)})


def test_text_no_store_can_write_is_refused_in_every_field() -> None:
    """A lone surrogate ("\\ud83d": half an emoji) or a number JSON cannot hold, anywhere in a job."""
    for field, value in [
        ("prompt", "Refund? \ud83d"),
        ("ticket_id", "T-\udcff"),
        ("response_format", _schema({"type": "string", "description": "\ud83d"})),
        ("response_format", {"type": "choice", "choices": ["ok", "n\ud83do"]}),
        ("response_format", _schema({"type": "number", "maximum": float("inf")})),
    ]:
        with pytest.raises(InvalidJob, match=r"not valid Unicode|JSON cannot hold"):
            Job.from_message({**MESSAGE, field: value})
    with pytest.raises(ValueError, match="not valid Unicode"):
        rf.parse({"type": "choice", "choices": ["\udc80"]})


def test_writers_never_fail_on_what_a_job_carried() -> None:
    result = {"text": "a\ud83db", "ticket_id": "\udcff", "fine": "📦"}
    written = encoding.to_bytes(result)
    assert json.loads(written) == {"text": "a\ufffdb", "ticket_id": "\ufffd", "fine": "📦"}
    assert encoding.to_text(result).encode("utf-8")


def test_a_deep_answer_is_refused_when_read_not_raised() -> None:
    """A recursive schema's answer ~300 levels deep: a ValueError of that row, never a RecursionError."""
    node = {"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    fmt = rf.parse(_schema(node))
    assert fmt is not None
    text = '{"c": ' * 300 + "null" + "}" * 300
    with pytest.raises(encoding.TooDeep):
        rf.read_output(fmt, text)


def test_a_grammar_dead_end_fails_its_row_as_invalid_job(backend: FuyuBackend) -> None:
    """`a[^\\s\\S]`: a pattern no string matches past its `a`; the row fails as the job's fault."""
    with pytest.raises(ValueError, match="negated class"):  # refused at submission now...
        rf.parse(_schema({"type": "string", "pattern": "a[^\\s\\S]"}))
    dead = {"type": "string", "pattern": "a[^\\s\\S]"}  # ...but another producer's message may carry it
    fmt = rf.JsonSchemaFormat.model_construct(type="json_schema", schema_=dead)
    constraint, _ = backend.grammars.constraint(fmt)
    row = Sequence("r", None, 1, 8, backend.eos_id, constraint=constraint)
    tokens = backend.processor.tokenizer.convert_tokens_to_ids(['"', "a"])
    assert not row.accept(tokens[0])
    assert not row.accept(tokens[1])
    assert row.accept(DEAD_END)
    assert isinstance(row.error, InvalidJob)
    assert "allows no continuation after 2 generated tokens" in row.error.message


def test_a_grammar_dead_at_its_start_fails_at_compile(backend: FuyuBackend) -> None:
    """A message from another producer may skip the submission checks: the worker refuses it alone."""
    dead = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}
    fmt = rf.JsonSchemaFormat.model_construct(type="json_schema", schema_=dead)
    with pytest.raises(InvalidJob, match="allows no answer"):
        backend.grammars.constraint(fmt)


# 120 draws in make test (~4 s alone here; 40 cost 25-55 s before the walk read allowed tokens off the
# engine's mask in one call); SCHEMA_DRAWS=2000 for a longer hunt.
@settings(
    max_examples=int(os.environ.get("SCHEMA_DRAWS", "120")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
@given(schema=schema_draws.wide, seed=st.integers(0, 2**16))
def test_a_drawn_schema_is_refused_at_submission_or_every_answer_validates(
    backend: FuyuBackend, schema: Any, seed: int
) -> None:
    try:
        fmt = rf.parse(_schema(schema))
    except ValueError:
        return  # refused, by name, before anything was queued
    assert fmt is not None
    grammars = backend.grammars
    tokenizer = backend.processor.tokenizer
    closers = {
        i
        for i in range(len(tokenizer))
        if tokenizer.convert_ids_to_tokens(i) in ('"', "]", "}", "<0x22>", "<0x5D>", "<0x7D>")
    }
    rng = random.Random(seed)
    finished = 0
    for _ in range(8):
        constraint, _seconds = grammars.constraint(fmt)  # compiles: every accepted schema must
        tokens = schema_draws.walk(grammars, constraint, backend.eos_id, rng, closers)
        if tokens is None:
            continue  # the walk ran long; not an answer
        text = backend.detokenize(tokens)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert rf.read_output(fmt, text) == value
        finished += 1
    assert finished, "no walk through the grammar finished"


@pytest.mark.parametrize(
    ("choices", "reason"),
    [
        ([" yes", "no"], "whitespace"),
        (["yes", "no "], "whitespace"),
        (["  ", "x"], "whitespace"),
        (["|ENDOFTEXT|", "z"], "control token"),
        (["<s>", "y"], "control token"),
    ],
)
def test_choices_the_answer_cannot_come_back_as_are_refused(choices: list[str], reason: str) -> None:
    """The tokenizer drops the space before the first word; a control token's text is the token."""
    with pytest.raises(ValueError, match=r"response_format\.choices") as refused:
        rf.parse({"type": "choice", "choices": choices})
    assert reason in str(refused.value)
