"""Whatever a job carries reaches the worker as it was sent: the queue's JSON (kombu's) reads an object
of exactly `__type__` and `__value__` back as a typed value, so such an object in a response_format
made the job's message unreadable, and Celery dropped it unanswered (review, helper-125: the job
stayed `queued` for good). The intake refuses it, on every surface (one model checks the format);
anything else the format may hold comes back from the queue's JSON unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.utils import json as kombu_json
from pydantic import ValidationError

from shared.jobs import Job
from shared.response_format import JsonSchemaFormat

TYPED = {"__type__": "datetime", "__value__": "2026-12-08T00:00:00"}


def _schema(default: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"type": "string", "default": default}}}


@pytest.mark.parametrize(
    "schema",
    [
        _schema(TYPED),
        _schema({"__type__": "no such type", "__value__": 1}),
        _schema([{"x": [TYPED]}]),
        {"type": "object", "properties": {"__type__": {"type": "string"}, "__value__": {"type": "string"}}},
    ],
)
def test_an_object_the_queue_would_read_as_a_typed_value_is_refused_with_its_place(schema: Any) -> None:
    with pytest.raises(ValidationError, match="exactly `__type__` and `__value__`"):
        JsonSchemaFormat.model_validate({"type": "json_schema", "schema": schema})


_KEYS = st.sampled_from(["__type__", "__value__", "a", "type"])
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(["datetime", "decimal", "x"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(default=_VALUES)
def test_a_format_the_intake_takes_comes_back_from_the_queues_json_as_it_was(default: Any) -> None:
    try:
        fmt = JsonSchemaFormat.model_validate({"type": "json_schema", "schema": _schema(default)})
    except ValidationError:
        return  # refused: never queued
    job = Job(job_id="j-1", image_uri="s3://mrc/a.jpg", prompt="Q?", max_new_tokens=8, response_format=fmt)
    message = job.to_message()
    assert kombu_json.loads(kombu_json.dumps(message)) == message
