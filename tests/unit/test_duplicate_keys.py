"""A JSON object naming one key twice is refused at every door that reads JSON, the same way (json
keeps the last value, so which was meant cannot be told), and a number of tokens is a whole number at
every door (review, helper-84, helper-85)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from producer.cli import _response_format
from producer.http.forms import JobRequest
from producer.openai.batch_lines import Translator, custom_id_of
from shared import encoding
from shared.errors import UsageError
from shared.settings import Settings

TWICE = '{"type": "object", "type": "string"}'


def test_the_shared_reader_names_the_key_given_twice() -> None:
    with pytest.raises(encoding.DuplicateKey, match="'type' is given more than once"):
        encoding.loads(TWICE)
    assert encoding.loads('{"a": {"b": 1}, "b": {"a": 2}}') == {"a": {"b": 1}, "b": {"a": 2}}


def test_a_batch_line_naming_a_key_twice_is_refused_as_the_chat_body_is() -> None:
    translator = Translator(SimpleNamespace(settings=Settings()), "/v1/chat/completions", None,  # type: ignore[arg-type]
                            frozenset({"tiny"}), set(), {})  # fmt: skip
    line = (
        b'{"custom_id": "c2", "custom_id": "c3", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    )
    refused: Any = translator._read(1, line)
    assert refused["status"] == 400
    assert refused["error"]["code"] == "invalid_json"
    assert "'custom_id' is given more than once" in refused["error"]["message"]


@pytest.mark.parametrize(
    ("line", "custom_id"),
    [
        ('{"custom_id": "c2", "custom_id": "c3", "method": "POST"}', None),  # which was meant?
        ('{"custom_id": "c2", "custom_id": "c2", "method": "POST"}', "c2"),
        ('{"custom_id": "c2", "custom_id": "c\\u0032", "method": "POST"}', "c2"),  # the same text
        ('{"custom_id": "c2", "method": "POST", "method": "GET"}', "c2"),
        ('{"custom_id": "c2", "body": {"custom_id": "x", "custom_id": "y"}}', "c2"),  # not the line's
        ('{"custom_id": "c\\udcff", "method": "POST", "method": "POST"}', "c\ufffd"),
        ('{"custom_id": 7, "custom_id": 7}', None),
        ("[1, 2]", None),
        ('{"custom_id": "c2", "method": ', None),
    ],
)
def test_a_refused_lines_custom_id_is_the_one_it_names_or_none(line: str, custom_id: str | None) -> None:
    assert custom_id_of(line.encode()) == custom_id


def test_a_refused_lines_custom_id_is_found_in_a_line_deep_with_custom_ids() -> None:
    """Review, helper-88: every object's custom_id value was serialised to compare it, so 980 nested
    {"custom_id": ...} around a 1 MB string took 10 s of the API's CPU (a parse takes 2 ms)."""
    depth = 900
    line = '{"custom_id":' * depth + '"' + "e" * 100_000 + '"' + "}" * depth
    assert custom_id_of(line.encode()) is None  # the line's custom_id is an object
    assert custom_id_of(('{"custom_id": "deep", "body": ' + line + "}").encode()) == "deep"


DEEP = "[" * 5_000 + "]" * 5_000  # past what json.loads can parse (RecursionError)


@pytest.mark.parametrize(
    ("line", "custom_id"),
    [
        (f'{{"custom_id": "c7", "body": {DEEP}}}', "c7"),
        (
            f' {{ "body" : {{"custom_id": "x", "m": {DEEP}, "s": "]}}\\\\"}} , "custom_id" : "c\\"7" }} ',
            'c"7',
        ),
        (f'{{"custom_id": "c7", "n": -1.5e3, "t": true, "z": null, "body": {DEEP}}}', "c7"),
        (f'{{"custom_id": "c7", "custom_id": "c8", "body": {DEEP}}}', None),  # which was meant?
        (f'{{"custom_id": "c7", "custom_id": "c7", "body": {DEEP}}}', "c7"),
        (f'{{"custom_id": "c\\udcff", "body": {DEEP}}}', "c\ufffd"),
        (f'{{"custom_id": 7, "body": {DEEP}}}', None),
        (f'{{"custom_id": {DEEP}}}', None),
        (f"[{DEEP}]", None),
        (f'{{"custom_id": "c7", "body": {DEEP[:-1]}}}', None),  # left open: not JSON at all
        (f'{{"custom_id": "c7", "body": , "b": {DEEP}}}', None),
        (f'{{"custom_id": "c7", "body": {DEEP}}} more', None),  # more after the object: not JSON
        # a broken top level after the deep value: not JSON either (review, helper-114)
        (f'{{"custom_id": "c7", "body": {DEEP}, "n": nope}}', None),
        (f'{{"custom_id": "c7", "body": {DEEP}, "n": truex}}', None),
        (f'{{"custom_id": "c7", "body": {DEEP}, "n": 01}}', None),
        (f'{{"custom_id": "c7", "body": {DEEP}, "n": 1.}}', None),
        (f'{{"custom_id": "c7", "body": {DEEP},}}', None),
        (f'{{"custom_id": "c7", "body": {DEEP}, , "n": 1}}', None),
        (f'{{"custom_id": "c7", "body": {DEEP}, 5: 1}}', None),
        (f'{{"custom_id": "c7", "body": {DEEP}, "n": -Infinity, "m": NaN, "k": -0.5E+2}}', "c7"),
        ('{"custom_id": "c7", "body": ' + "[" * 1_100 + '""' * 300_000 + "]" * 1_100 + "}", None),
    ],
)
def test_a_line_nested_past_the_parser_still_names_its_custom_id(line: str, custom_id: str | None) -> None:
    """Review, helper-112: a line nested past what json can parse was "not JSON", answered with no
    custom_id, so a client could not tell which of its requests had failed, or why."""
    assert custom_id_of(line.encode()) == custom_id
    translator = Translator(SimpleNamespace(settings=Settings()), "/v1/chat/completions", None,  # type: ignore[arg-type]
                            frozenset({"tiny"}), set(), {})  # fmt: skip
    refused: Any = translator._read(1, line.encode())
    assert (refused["status"], refused["error"]["code"], refused.get("custom_id")) == (
        400,
        "invalid_json",
        custom_id,
    )
    if custom_id is not None:
        assert refused["error"]["message"] == "the line is nested too deeply to be read"
        assert translator.seen == {custom_id: 1}  # used up, as a refused line's id is


def test_a_manifest_line_nested_too_deeply_names_its_custom_id() -> None:
    from producer.backlog import manifest

    for body in ("[" * 70 + "]" * 70, DEEP):  # past mrc's bound of 64; past json's
        line = f'{{"custom_id": "m4", "prompt": "p", "x": {body}}}'.encode()
        item = manifest.parse(4, line, "r", Settings())
        assert isinstance(item, manifest.Invalid)
        assert item.custom_id == "m4"
        assert "nested" in item.reason
    item = manifest.parse(4, f'{{"custom_id": "m\\udcff", "x": {DEEP}}}'.encode(), "r", Settings())
    assert isinstance(item, manifest.Invalid)
    assert item.custom_id is None  # no store could write it


def test_a_refused_lines_custom_id_is_used_up_as_an_accepted_lines_is() -> None:
    """Review, helper-88: a line refused as ambiguous kept its custom_id "r" in the error file, and a
    later line "r" ran too, so "r" was answered in both files."""
    translator = Translator(SimpleNamespace(settings=Settings()), "/v1/chat/completions", None,  # type: ignore[arg-type]
                            frozenset({"tiny"}), set(), {})  # fmt: skip
    twice: Any = translator._read(1, b'{"custom_id": "r", "method": "POST", "method": "POST"}')
    assert (twice["error"]["code"], twice["custom_id"]) == ("invalid_json", "r")
    unwritable: Any = translator._read(2, b'{"custom_id": "u", "method": "\\udcff"}')
    assert (unwritable["error"]["code"], unwritable["custom_id"]) == ("invalid_value", "u")
    for number, custom_id in ((3, "r"), (4, "u")):
        again: Any = translator._read(number, f'{{"custom_id": "{custom_id}", "method": "POST"}}'.encode())
        assert again["error"]["code"] == "duplicate_custom_id", again


def test_a_line_refused_unread_after_an_accepted_line_of_its_id_is_that_duplicate() -> None:
    """Review, helper-113: a line refused as ambiguous, unwritable or too deep, naming an id an
    earlier line was accepted under, was answered under that id too: "c1" in both files."""
    translator = Translator(SimpleNamespace(settings=Settings()), "/v1/chat/completions", None,  # type: ignore[arg-type]
                            frozenset({"tiny"}), set(), {})  # fmt: skip
    translator.seen["c1"] = 1  # line 1 was accepted under "c1"
    refused = [
        b'{"custom_id": "c1", "method": "POST", "method": "POST"}',
        b'{"custom_id": "c1", "method": "\\udcff"}',
        f'{{"custom_id": "c1", "body": {DEEP}}}'.encode(),
    ]
    for number, line in enumerate(refused, start=2):
        again: Any = translator._read(number, line)
        assert (again["error"]["code"], again["custom_id"]) == ("duplicate_custom_id", "c1"), again
        assert "line 1" in again["error"]["message"]
    assert translator.seen == {"c1": 1}


def test_a_resumed_batch_refuses_again_the_duplicates_it_refused_before_it_stopped() -> None:
    """Review, helper-89: the ids an earlier pass indexed were mapped to their last line, so on a
    resume the refused duplicate of "k" (line 3) found itself as k's line and was queued."""
    from producer.openai.batch_run import first_lines

    entries = [
        {"line": 1, "custom_id": "k", "job_id": "batch.k"},
        {"line": 2, "custom_id": "u", "job_id": "batch.u"},
        {"line": 3, "custom_id": "k", "invalid": '{"status": 400}'},
        {"line": 4, "invalid": "not JSON"},
    ]
    assert first_lines(entries) == {"k": 1, "u": 2}
    assert first_lines(reversed(entries)) == {"k": 1, "u": 2}
    translator = Translator(SimpleNamespace(settings=Settings()), "/v1/chat/completions", None,  # type: ignore[arg-type]
                            frozenset({"tiny"}), set(), first_lines(entries))  # fmt: skip
    line = b'{"custom_id": "k", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    again: Any = translator._read(3, line)
    assert again["error"]["code"] == "duplicate_custom_id", again
    own: Any = translator._read(1, line)  # the id's own line, read again: not a duplicate of itself
    assert own["error"]["code"] != "duplicate_custom_id", own


def test_a_line_refused_unread_names_no_custom_id_and_its_ending_is_not_counted() -> None:
    """Review, helper-89: a line just over the limit was refused unread (its id not used up), yet the
    error file parsed it and named its id, so a later line with that id answered under it too; and a
    line of exactly the limit was refused when a newline followed it."""
    import json

    from producer.openai.batch_output import _line

    translator = Translator(SimpleNamespace(settings=Settings()), "/v1/chat/completions", None,  # type: ignore[arg-type]
                            frozenset({"tiny"}), set(), {})  # fmt: skip
    line = b'{"custom_id": "big", "method": "POST", "pad": "' + b"x" * 20 + b'"}'
    translator.max_bytes = len(line)
    fits: Any = translator._read(1, line + b"\r\n")
    assert fits["error"]["code"] != "line_too_long", fits
    over: Any = translator._read(2, line + b" \n")
    assert (over["error"]["code"], over.get("custom_id")) == ("line_too_long", None)
    entry = {"line": 2, "invalid": json.dumps({"status": over["status"], "error": over["error"]})}
    assert _line("batch", 2, line + b" \n", entry, None, "")[1]["custom_id"] is None
    assert _line("batch", 3, line, None, None, "cancelled")[1]["custom_id"] == "big"  # never reached


def test_a_line_over_the_limit_whose_cut_falls_on_carriage_returns_is_still_too_long() -> None:
    """Review, helper-90: the reader cuts a long line at the limit + 2 bytes and drops the rest; every
    CR stripped from that cut, "a" at the limit followed by CR CR and more was read as "a" alone."""
    import io

    from producer.backlog import manifest

    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    file = line + b"\r\r junk past the limit\n" + line + b"\n"
    (first, raw), (second, _next) = manifest.read_lines(io.BytesIO(file), len(line))
    assert (first, second, raw) == (1, 2, line + b"\r\r")
    translator = Translator(SimpleNamespace(settings=Settings()), "/v1/chat/completions", None,  # type: ignore[arg-type]
                            frozenset({"tiny"}), set(), {})  # fmt: skip
    translator.max_bytes = len(line)
    over: Any = translator._read(1, raw)
    assert (over["error"]["code"], over.get("custom_id")) == ("line_too_long", None)
    assert (
        manifest.content(line + b"\r\n") == manifest.content(line + b"\n") == manifest.content(line) == line
    )
    assert manifest.content(line + b"\r\r") == line + b"\r\r"


def test_mrc_submit_refuses_a_schema_naming_a_key_twice() -> None:
    with pytest.raises(UsageError, match="'type' is given more than once"):
        _response_format(argparse.Namespace(choice=None, json_schema=TWICE))


def test_a_multipart_response_format_naming_a_key_twice_says_so() -> None:
    with pytest.raises(ValidationError, match="'type' is given more than once"):
        JobRequest.model_validate({"image": "", "prompt": "p", "response_format": TWICE})


@pytest.mark.parametrize("value", ["5", True, 5.0])
def test_the_python_client_takes_a_whole_number_of_tokens_only(value: Any) -> None:
    """Review, helper-85: Client.submit(max_new_tokens="5") raised a bare TypeError; True and 5.0 ran.
    The same check every door makes, with a UsageError naming it."""
    from producer.client import Client, Submission

    client = Client(Settings())  # validate() reaches neither Redis nor S3
    with pytest.raises(UsageError, match="max_new_tokens must be a whole number"):
        client.validate(Submission(image="s3://b/x.jpg", prompt="p", max_new_tokens=value))
