"""Bounds a response_format sets against what max_new_tokens can ever emit (issue 36, item 9): a bound
no answer of the job's tokens can satisfy or reach is refused at submission, by every producer
surface and by the worker's first look at a message, with the schema's place in the message.

An answer of N tokens holds at most N x MRC_MAX_TOKEN_CHARS characters (every token of the model's
vocabulary decodes to at most that many): at the default 64 tokens and 32 characters, 2,048."""

from __future__ import annotations

import json
from typing import Any

import pytest

from producer.backlog import manifest
from producer.backlog.manifest import Invalid
from producer.client import Client, Submission
from producer.openai.chat_request import parse_chat
from producer.openai.errors import OpenAIError
from shared import response_format as rf
from shared.errors import InvalidJob, UsageError
from shared.jobs import limit_problem
from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from workers import stages

SETTINGS = Settings(allowed_buckets=["photos"])
ISSUE = {"type": "object", "properties": {"note": {"type": "string", "pattern": "^[a-z]{1,20000}$"}}}
PLACE = "response_format.schema.properties.note.pattern"


def _fmt(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "schema": schema}


def _problem(fmt: dict[str, Any], tokens: int | None = 64, settings: Settings = SETTINGS) -> str | None:
    return limit_problem(settings, "Refund?", tokens, response_format=rf.parse(fmt))


def test_the_issue_schema_is_refused_by_every_surface_naming_its_place() -> None:
    fmt = _fmt(ISSUE)
    assert PLACE in str(_problem(fmt))
    assert "{1,20000}" in str(_problem(fmt))
    assert PLACE in str(_problem(fmt, tokens=None))  # max_new_tokens left out: the default's reach
    # mrc submit, Client.submit/submit_many and POST /v1/jobs (the intake: Intake.validate / .job)
    store = MemoryStore("mrc")
    client = Client(SETTINGS, images=store, results=store, records=MemoryJobRecords())
    with pytest.raises(UsageError, match=PLACE):
        client.validate(Submission("s3://mrc/inputs/a.jpg", "Refund?", response_format=fmt))
    # a backlog manifest line (mrc backlog, and the OpenAI batch's lines once translated)
    line = {"custom_id": "c1", "image": "s3://photos/a.jpg", "prompt": "Refund?", "response_format": fmt}
    refused = manifest.parse(1, json.dumps(line).encode(), "run-1", SETTINGS)
    assert isinstance(refused, Invalid)
    assert PLACE in refused.reason
    # /v1/chat/completions and a /v1/batches line: OpenAI's names for the place
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Refund?"},
            {"type": "image_url", "image_url": {"url": "s3://mrc/inputs/a.jpg"}},
        ]}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": ISSUE}},
    }  # fmt: skip
    for batch in (False, True):
        with pytest.raises(OpenAIError) as caught:
            parse_chat(body, SETTINGS, batch=batch)
        assert caught.value.param == "response_format.json_schema.schema"
        assert "response_format.json_schema.schema.properties.note.pattern" in caught.value.message
    # the worker's first look, for a message another producer sent
    message = {"job_id": "j1", "image_uri": "s3://mrc/a.jpg", "prompt": "Refund?", "max_new_tokens": 64}
    with pytest.raises(InvalidJob, match=PLACE):
        stages.check_limits(stages.parse({**message, "response_format": fmt}), SETTINGS)


STRING = {"type": "string"}
INTEGERS = {"type": "array", "items": {"type": "integer"}}


@pytest.mark.parametrize(
    ("schema", "place", "words"),
    [
        # lower bounds no answer of 2,048 characters can meet (it could only end answer_incomplete)
        ({"type": "string", "pattern": "^[a-z]{2100}$"}, "schema.pattern", "at least 2102"),
        ({"type": "string", "pattern": "^(ab[c-z]{50}){40}$"}, "schema.pattern", "at least 2082"),  # nested
        ({"type": "string", "pattern": "^" + "abcdefgh" * 260 + "$"}, "schema.pattern", "at least 2082"),
        ({"type": "string", "minLength": 3000}, "schema.minLength", "at least 3002"),
        ({**INTEGERS, "minItems": 1000}, "schema.minItems", "at least 3000"),
        (
            {"type": "array", "minItems": 30, "items": {"type": "string", "minLength": 100}},
            "schema.minItems",
            "at least 3120",
        ),
        (
            {
                "type": "object",
                "properties": {k: {"type": "string", "minLength": 700} for k in "abc"},
                "required": ["a", "b", "c"],
            },
            "schema.required",
            "at least 2127",
        ),
        ({"enum": ["short", "x" * 3000]}, "schema.enum.1", "3002"),
        (
            {"anyOf": [{**STRING, "minLength": 2500}, {**STRING, "minLength": 3000}]},
            "schema.anyOf.0.minLength",
            "at least 2502",
        ),
        # upper bounds no answer of 2,048 characters can reach (it can never bind)
        ({"type": "string", "pattern": "^[a-z]{1,3000}$"}, "schema.pattern", "{1,3000}"),
        ({"type": "string", "pattern": "^(a?){1,3000}$"}, "schema.pattern", "{1,3000}"),
        ({"type": "string", "pattern": "^([a-z]{1,3}x){0,1100}$"}, "schema.pattern", "{0,1100}"),
        ({"type": "string", "maxLength": 5000}, "schema.maxLength", "5000"),
        ({**INTEGERS, "maxItems": 1000}, "schema.maxItems", "1000"),
        (
            {"type": "object", "properties": {"tags": {**INTEGERS, "maxItems": 1000}}},
            "schema.properties.tags.maxItems",
            "1000",
        ),
        (
            {"$defs": {"n": {"type": "string", "maxLength": 9999}}, "$ref": "#/$defs/n"},
            "schema.$defs.n.maxLength",
            "9999",
        ),
    ],
)
def test_bounds_past_what_max_new_tokens_can_emit_are_refused_by_place(
    schema: dict[str, Any], place: str, words: str
) -> None:
    problem = str(_problem(_fmt(schema)))
    assert f"response_format.{place}:" in problem, problem
    assert words in problem, problem
    assert "max_new_tokens 64 holds more than 2048 characters" in problem, problem


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^[a-z]{1,2000}$"},
        {"type": "string", "pattern": "^(a[b-z]{1,50}){1,40}$"},  # each bound can bind within 2,048
        {"type": "string", "maxLength": 2000},
        {**INTEGERS, "minItems": 600, "maxItems": 600},
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # recursive: its shortest answer is {}
    ],
)
def test_bounds_within_reach_are_accepted(schema: dict[str, Any]) -> None:
    assert _problem(_fmt(schema)) is None


def test_the_reach_follows_the_jobs_tokens_and_the_token_length_setting() -> None:
    fmt = _fmt({"type": "string", "pattern": "^[a-z]{1,3000}$"})
    assert _problem(fmt, tokens=64) is not None
    assert _problem(fmt, tokens=128) is None  # 4,096 characters
    assert "MRC_MAX_TOKEN_CHARS 8" in str(_problem(fmt, 128, Settings(max_token_chars=8)))


def test_choices_no_answer_can_hold_are_refused() -> None:
    problem = str(_problem({"type": "choice", "choices": ["refund", "x" * 3000]}))
    assert "response_format.choices.1: the choice is 3000 characters" in problem
    assert _problem({"type": "choice", "choices": ["refund", "x" * 2000]}) is None


def test_bounds_the_decoder_does_not_enforce_at_all_stay_refused_by_name() -> None:
    """maxProperties/minProperties are refused as keywords (not enforced), whatever their value."""
    with pytest.raises(ValueError, match="'maxProperties' is not enforced"):
        rf.parse(_fmt({"type": "object", "maxProperties": 100000}))
