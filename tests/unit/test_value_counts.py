"""JSON holding more values than any input could is refused before it is parsed, at every door that
reads a client's JSON (review, helper-97: a 45 MB chat body of 15 million `{}` took mrc-api to 3.4 GB
before its 256-message limit could refuse it; a batch line did the same on the batch threads)."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace
from typing import Any

import pytest

from producer.http import forms
from producer.openai.batch_lines import Translator, custom_id_of
from producer.openai.chat_request import read_json
from producer.openai.errors import OpenAIError
from shared import encoding
from shared.settings import Settings

LIMIT = encoding.MAX_VALUES


def _many(count: int) -> bytes:
    """A body of `count` empty objects: 2 × count + 2 commas and opening brackets."""
    return b'{"model": "tiny", "messages": [' + b"{}," * (count - 1) + b"{}]}"


def test_values_are_counted_by_their_commas_and_brackets_outside_strings() -> None:
    assert encoding.values_problem(_many(LIMIT // 2 - 1)) is None
    assert "more than 100000 commas and opening brackets" in str(encoding.values_problem(_many(LIMIT // 2)))
    assert encoding.values_problem(_many(LIMIT // 2).decode()) == encoding.values_problem(_many(LIMIT // 2))
    # Commas and brackets inside strings (a prompt, escaped quotes among them) are not values.
    text = '{"prompt": "' + ",[{" * LIMIT + '\\"' + ",," * 10 + '", "x": [1, 2]}'
    assert encoding.values_problem(text) is None
    assert encoding.values_problem(text.encode()) is None
    # A string never closed holds what follows it: no value, and the parser stops at it at once.
    assert encoding.values_problem('"' + "[" * (LIMIT + 5)) is None
    with pytest.raises(ValueError, match="Unterminated string"):
        encoding.loads('"' + "[" * (LIMIT + 5))


def test_a_hostile_body_is_refused_without_building_it() -> None:
    body = _many(1_500_000).decode()  # 4.5 MB: before, ~345 MB of Python objects
    tracemalloc.start()
    try:
        with pytest.raises(OpenAIError) as refused:
            read_json(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.status == 400
    assert refused.value.code == "invalid_value"
    assert "too many values" in refused.value.message
    assert peak < 3 * len(body), peak


def test_every_door_that_reads_a_clients_json_refuses_it() -> None:
    body = _many(LIMIT // 2)
    with pytest.raises(encoding.TooMany):
        encoding.loads(body)
    reply: Any = forms.parsed(body)
    assert reply.status_code == 422
    assert b"too many values" in reply.body
    translator = Translator(SimpleNamespace(settings=Settings()), "/v1/chat/completions", None,  # type: ignore[arg-type]
                            frozenset({"tiny"}), set(), {})  # fmt: skip
    refused: Any = translator._read(1, b'{"custom_id": "c1", "body": ' + body + b"}")
    assert (refused["status"], refused["error"]["code"], refused.get("custom_id")) == (
        400,
        "invalid_value",
        None,
    )
    assert "too many values" in refused["error"]["message"]
    assert custom_id_of(b'{"custom_id": "c1", "body": ' + body + b"}") is None  # the error file's read
    assert custom_id_of(b'{"custom_id": "c1", "body": ' + _many(10) + b"}") == "c1"


@pytest.mark.parametrize("ending", [b"", b"\\"])
def test_a_string_left_open_is_read_once_not_from_every_quote_in_it(ending: bytes) -> None:
    """Review, helper-100: `"\\"\\"\\"...` left open failed the string's match at the end of the text,
    and the search began again at every escaped quote: O(n^2) under the GIL, 24.6 s for 80 KB while
    every route waited (here 600 KB: the old reading would pass pytest's 600 s limit). A string never
    closed now runs to the end of the text."""
    body = b"[" + b"," * (LIMIT + 1) + b'"' + b'\\"' * 300_000 + ending
    assert encoding.values_problem(body) is not None
    assert encoding.values_problem(body.decode()) is not None
    assert encoding.values_problem(b'["' + b'\\"' * 300_000 + b"," * (LIMIT + 1) + ending) is None  # in it


@pytest.mark.parametrize("kind", ["utf-16-le", "utf-16", "utf-32-be"])
def test_json_in_utf16_or_utf32_is_counted_as_json_reads_it(kind: str) -> None:
    """Review, helper-100: json.loads reads UTF-16 and UTF-32 bytes, where a quote is not the byte 0x22
    and U+2200 holds one (00 22): a batch line in UTF-16 turned the count inside out and passed it,
    and its 2 million values were parsed."""
    line = '{"junk": ["\u2200", ' + "{}," * (LIMIT // 2) + '""], "custom_id": "a"}'
    assert encoding.values_problem(line.encode(kind)) is not None
    assert custom_id_of(line.encode(kind)) is None
    assert encoding.values_problem('{"a": ["\u2200", {}, ""]}'.encode(kind)) is None


def test_strings_full_of_escapes_or_past_counting_are_read_at_c_speed() -> None:
    """Review, helper-101: past the count, each escape pair was a step of the string regex (2-4 s over
    45 MB); escapes are taken out by str.replace now, and more strings than any request holds are
    refused from the count of quotes alone (15 million `""` was 15 million matches)."""
    many_strings = b"[" + b'"",' * (2 * LIMIT + 1) + b'""]'
    assert "strings" in str(encoding.values_problem(many_strings))
    assert encoding.values_problem(b"[" + b'"a",' * (LIMIT // 2) + b"1]") is None  # 50,000 strings: real
    backslash_last = '["' + "," * (LIMIT + 1) + '\\\\", 1]'  # an escaped backslash, then the closing quote
    assert encoding.values_problem(backslash_last) is None
    assert encoding.values_problem('["\\\\", ' + "1," * (LIMIT + 1) + "1]") is not None
