from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import ERROR_CODES, InvalidJob, MrcError
from shared.jobs import Job, JobResult

GOOD = {"job_id": "j-1", "image_uri": "s3://mrc/inputs/x.jpg", "prompt": "refund?", "max_new_tokens": 8}


def test_round_trip_through_the_message_form() -> None:
    job = Job.from_message(GOOD)
    assert Job.from_message(job.to_message()) == job
    assert job.to_message()["schema"] == "mrc.job/1"
    assert job.lane == "interactive"


@pytest.mark.parametrize(
    "change",
    [
        {"prompt": ""},
        {"prompt": " \n\t"},
        {"prompt": "a\x00b"},
        {"max_new_tokens": 0},
        {"lane": "vip"},
        {"job_id": "has space"},
        {"job_id": "x" * 200},
        {"schema": "mrc.job/2"},
        {"image_uri": None},
        {"deadline": "tomorrow"},
        {"deadline": "2026-12-01T10:00:00"},
        {"deadline": "20300630T120000Z"},  # ISO 8601's basic form, not RFC 3339 (review)
        {"deadline": "2030-06-30T12:00Z"},  # no seconds
        {"deadline": "2030-06-30T12:00:00+0200"},  # a zone without its colon
        {"deadline": "2030-06-30T12:00:00999999Z"},  # digits past the seconds without their dot
        {"deadline": "2030-06-30T12:00:00+05:99"},  # an offset's minutes past 59 (review: read as +06:39)
        {"deadline": "2030-06-30T12:00:00+24:00"},
        {"submitted_at": "not a time"},
    ],
)
def test_bad_fields_are_invalid_job(change: dict[str, object]) -> None:
    with pytest.raises(InvalidJob):
        Job.from_message({**GOOD, **change})


@pytest.mark.parametrize(
    "deadline", ["2030-06-30t12:00:00z", "2030-06-30T23:59:60Z", "2030-06-30 12:00:00.123456789+02:00"]
)
def test_every_rfc_3339_form_is_a_deadline(deadline: str) -> None:
    """Review: lower case and a leap second were refused (RFC 3339 has both)."""
    assert Job.from_message({**GOOD, "deadline": deadline}).deadline == deadline


@pytest.mark.parametrize("body", [None, "text", 3, ["list"]])
def test_non_objects_are_invalid_job(body: object) -> None:
    with pytest.raises(InvalidJob):
        Job.from_message(body)


@given(st.dictionaries(st.text(max_size=10), st.one_of(st.none(), st.integers(), st.text()), max_size=6))
def test_arbitrary_json_objects_parse_or_fail_cleanly(body: dict[str, object]) -> None:
    try:
        Job.from_message(body)
    except InvalidJob as exc:  # the only exception allowed out, and always with its code
        code = exc.code
    else:
        code = "invalid_job"
    assert code == "invalid_job"


def test_every_error_class_has_a_contract_code() -> None:
    import shared.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, MrcError)]
    assert {c.code for c in classes} <= set(ERROR_CODES) | set(errors.PRODUCER_CODES)
    assert set(ERROR_CODES) <= {c.code for c in classes}
    # docs/contract.md, "Error codes": exactly these, no more, no fewer.
    assert set(ERROR_CODES) == {
        "invalid_job", "image_not_found", "image_source_forbidden", "unsupported_image_format",
        "image_decode_error", "image_too_large", "prompt_too_long", "out_of_memory", "model_error",
        "expired", "cancelled", "answer_incomplete", "internal_error",
    }  # fmt: skip


def test_result_serialises_with_the_contract_field_names() -> None:
    result = JobResult.model_validate(
        {
            "job_id": "j",
            "status": "succeeded",
            "text": "yes",
            "image": {"uri": "s3://b/k"},
            "model": {"id": "m", "quantization": "nf4"},
            "submitted_at": "2026-01-01T00:00:00Z",
        }
    ).to_json_dict()
    assert list(result) == [
        "schema", "job_id", "status", "text", "error", "finish_reason", "lane", "ticket_id", "attempts",
        "image", "prompt", "model", "cache_hit", "timings_ms", "usage", "submitted_at", "finished_at",
        "response_format", "output", "job_fingerprint",
    ]  # fmt: skip
    assert result["usage"] == {
        "prompt_tokens": 0,
        "image_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
        "cached_tokens": 0,
    }
    assert result["schema"] == "mrc.result/1"
    assert list(result["timings_ms"]) == ["queued", "preprocess", "inference", "first_token", "total"]


def test_queue_entries_that_are_not_envelopes_are_recognised() -> None:
    from shared.queue_entries import parse_envelope

    assert parse_envelope(b'{"body": "", "properties": {"delivery_tag": "x"}}') is not None
    for raw in (b"{not json", b"[1, 2]", b'{"body": "x"}', b"\xff\xfe", b'"text"'):
        assert parse_envelope(raw) is None
