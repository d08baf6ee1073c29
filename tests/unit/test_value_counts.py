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
    assert encoding.values_problem('"' + "[" * (LIMIT + 5)) is not None  # a string never closed: counted


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
