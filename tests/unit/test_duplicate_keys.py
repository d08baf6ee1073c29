"""A JSON object naming one key twice is refused at every door that reads JSON, the same way (review,
helper-84, helper-85): json keeps the last value, so which was meant cannot be told."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from producer.cli import _response_format
from producer.http.forms import JobRequest
from producer.openai.batch_lines import Translator
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


def test_mrc_submit_refuses_a_schema_naming_a_key_twice() -> None:
    with pytest.raises(UsageError, match="'type' is given more than once"):
        _response_format(argparse.Namespace(choice=None, json_schema=TWICE))


def test_a_multipart_response_format_naming_a_key_twice_says_so() -> None:
    with pytest.raises(ValidationError, match="'type' is given more than once"):
        JobRequest.model_validate({"image": "", "prompt": "p", "response_format": TWICE})
