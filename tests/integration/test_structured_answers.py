"""Structured answers end to end: `mrc submit --json-schema/--choice`, backlog manifest lines and
POST /v1/jobs (JSON and multipart), through the session's real worker (tiny Fuyu, NF4, CPU).

The tiny Fuyu has random weights: only the grammar makes its answers parse, so every `output` that
validates here is the constraint's doing."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from producer.client import Client
from producer.server import create_app
from scripts import devservices as services
from scripts.devservices import Worker, run_cli
from tests.support import imagegen
from tests.support.refund import REFUND_SCHEMA

pytestmark = pytest.mark.integration

REFUND = REFUND_SCHEMA
CHOICES = ["refund", "replace", "no_action"]
KEY = "k-structured"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def photo(tmp_path: Path) -> Path:
    path = tmp_path / "parcel.jpg"
    path.write_bytes(imagegen.photo(160, 120, seed=41))
    return path


@pytest.fixture
def api(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    api_env = {**env, "MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(), **services.shared_inputs(env)}
    with TestClient(create_app(services.settings_from_env(api_env))) as client:
        yield client


def _submit(env: dict[str, str], photo: Path, *extra: str) -> Any:
    return run_cli(
        env, "submit", "--image", str(photo), "--prompt", "Refund?", "--wait", "--timeout", "120", *extra
    )


def _result(api: TestClient, job_id: str) -> dict[str, Any]:
    for _ in range(8):  # each wait is bounded; a slow machine may need more than one
        reply = api.get(f"/v1/jobs/{job_id}/result", params={"wait": 30}, headers=AUTH)
        if reply.status_code == 200:
            return dict(reply.json())
    raise AssertionError(f"no result for {job_id}")


def test_submit_with_a_schema_file_and_with_choices(env: dict[str, str], worker: Worker, photo: Path) -> None:
    schema_file = photo.parent / "refund.json"
    schema_file.write_text(json.dumps(REFUND))
    done = _submit(env, photo, "--json-schema", str(schema_file), "--max-new-tokens", "96")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "succeeded"
    jsonschema.validate(result["output"], REFUND)
    assert json.loads(result["text"]) == result["output"]
    assert result["response_format"] == {"type": "json_schema", "schema": REFUND}
    assert result["finish_reason"] == "stop"

    done = _submit(env, photo, "--choice", " refund, replace,no_action ", "--max-new-tokens", "16")
    assert done.returncode == 0, done.stderr
    chosen = json.loads(done.stdout)
    assert chosen["output"] in CHOICES
    assert chosen["text"] == chosen["output"]
    assert chosen["response_format"] == {"type": "choice", "choices": CHOICES}

    free = json.loads(_submit(env, photo, "--max-new-tokens", "8").stdout)
    assert free["output"] is None
    assert free["response_format"] is None


def test_the_same_constrained_question_again_is_answered_from_the_cache(
    env: dict[str, str], worker: Worker, photo: Path
) -> None:
    inline = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    first = json.loads(_submit(env, photo, "--json-schema", inline, "--max-new-tokens", "24").stdout)
    again = json.loads(_submit(env, photo, "--json-schema", inline, "--max-new-tokens", "24").stdout)
    assert again["cache_hit"] is True
    assert again["output"] == first["output"]
    assert isinstance(again["output"]["ok"], bool)
    other = json.loads(_submit(env, photo, "--choice", "yes,no", "--max-new-tokens", "24").stdout)
    assert other["cache_hit"] is False  # another format is another answer
    assert other["output"] in ("yes", "no")


def test_an_answer_cut_by_max_new_tokens_fails_answer_incomplete(
    env: dict[str, str], worker: Worker, photo: Path
) -> None:
    done = _submit(env, photo, "--json-schema", json.dumps(REFUND), "--max-new-tokens", "3")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "failed"
    assert result["error"]["code"] == "answer_incomplete"
    assert result["error"]["retryable"] is False
    assert result["text"].startswith("{")
    assert result["output"] is None
    assert result["usage"]["completion_tokens"] == 3
    timings = result["timings_ms"]  # its tokens came: when the first did is said (it read 0.0: review)
    assert timings["queued"] <= timings["first_token"] <= timings["total"]
    assert timings["first_token"] > 0
    assert worker.logged("MRC_ERROR", job_id=result["job_id"])[0]["code"] == "answer_incomplete"


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--json-schema", '{"oneOf": [{"type": "integer"}]}'], "'oneOf' is not enforced"),
        (["--json-schema", '{"type": "strng"}'], "not valid JSON Schema"),
        (["--json-schema", "{not json"], "not JSON"),
        (["--json-schema", "/no/such/schema.json"], "neither inline JSON nor a readable file"),
        (["--json-schema", '{"type": "string", "format": "email"}'], "'format' is not enforced"),
        (["--choice", "refund,refund"], "listed twice"),
        (["--choice", "refund,,no"], "empty string"),
        (["--choice", "a", "--json-schema", "{}"], "not allowed with"),
    ],
)
def test_submit_refuses_formats_the_decoder_cannot_enforce(
    env: dict[str, str], photo: Path, flags: list[str], reason: str
) -> None:
    done = run_cli(env, "submit", "--image", str(photo), "--prompt", "Refund?", *flags)
    assert done.returncode == 2, (flags, done.stderr)
    assert done.stdout == ""
    assert reason in done.stderr


def test_over_the_size_and_count_limits_is_refused(env: dict[str, str], photo: Path) -> None:
    small = {**env, "MRC_MAX_CHOICES": "2", "MRC_MAX_RESPONSE_FORMAT_BYTES": "100"}
    done = run_cli(small, "submit", "--image", str(photo), "--prompt", "p", "--choice", "a,b,c")
    assert done.returncode == 2
    assert "the limit is 2" in done.stderr
    schema = json.dumps({"enum": ["x" * 200]})
    done = run_cli(small, "submit", "--image", str(photo), "--prompt", "p", "--json-schema", schema)
    assert done.returncode == 2
    assert "the limit is 100" in done.stderr


def test_the_api_takes_formats_as_json_and_as_a_multipart_field(
    api: TestClient, client: Client, photo: Path, worker: Worker
) -> None:
    uploaded = client.upload_image(photo)[0]
    job_id = f"structured-json-{time.monotonic_ns()}"
    body = {"image": uploaded, "prompt": "Refund?", "job_id": job_id, "max_new_tokens": 96,
            "response_format": {"type": "json_schema", "schema": REFUND}}  # fmt: skip
    assert api.post("/v1/jobs", json=body, headers=AUTH).status_code == 202
    result = _result(api, job_id)
    jsonschema.validate(result["output"], REFUND)

    job_id = f"structured-multipart-{time.monotonic_ns()}"
    form = {"prompt": "Refund?", "job_id": job_id, "max_new_tokens": "16",
            "response_format": json.dumps({"type": "choice", "choices": CHOICES})}  # fmt: skip
    reply = api.post("/v1/jobs", data=form, files={"image": ("p.jpg", photo.read_bytes())}, headers=AUTH)
    assert reply.status_code == 202, reply.text
    assert _result(api, job_id)["output"] in CHOICES


@pytest.mark.parametrize(
    ("fmt", "reason"),
    [
        ({"type": "choice", "choices": []}, "the list is empty"),
        ({"type": "choice", "choices": ["a", "a"]}, "listed twice"),
        ({"type": "json_schema", "schema": {"allOf": [{"type": "integer"}]}}, "'allOf' is not enforced"),
        ({"type": "json_schema", "schema": {"$ref": "http://example.com/x"}}, "never fetched"),
        ({"type": "grammar", "grammar": "root ::= 'a'"}, "response_format"),
        ("{not json", "not JSON"),
        (  # the queue's JSON reads it as a typed value: the job was dropped unanswered (helper-125)
            {"type": "json_schema", "schema": {"default": {"__type__": "nope", "__value__": 1}}},
            "exactly `__type__` and `__value__`",
        ),
    ],
)
def test_the_api_refuses_bad_formats_with_422_and_its_reason(
    api: TestClient, client: Client, photo: Path, fmt: Any, reason: str
) -> None:
    before = client.lane_depth("interactive")
    if isinstance(fmt, str):  # a multipart field that is not JSON
        form = {"prompt": "Refund?", "response_format": fmt}
        reply = api.post("/v1/jobs", data=form, files={"image": ("p.jpg", photo.read_bytes())}, headers=AUTH)
    else:
        body = {"image": "s3://mrc/x.jpg", "prompt": "Refund?", "response_format": fmt}
        reply = api.post("/v1/jobs", json=body, headers=AUTH)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["code"] == "invalid_job"
    assert reason in reply.json()["error"]["message"]
    assert client.lane_depth("interactive") == before


def test_manifest_lines_carry_formats_and_bad_ones_are_refused(
    env: dict[str, str], worker: Worker, client: Client, photo: Path
) -> None:
    uploaded = client.upload_image(photo)[0]
    lines = [
        {"custom_id": "s-1", "image": uploaded, "prompt": "Refund?", "max_new_tokens": 96,
         "response_format": {"type": "json_schema", "schema": REFUND}},
        {"custom_id": "s-2", "image": uploaded, "prompt": "Refund?", "max_new_tokens": 16,
         "response_format": {"type": "choice", "choices": CHOICES}},
        {"custom_id": "s-3", "image": uploaded, "prompt": "Refund?",
         "response_format": {"type": "choice", "choices": ["a", "a"]}},
        {"custom_id": "s-4", "image": uploaded, "prompt": "Refund?",
         "response_format": {"type": "json_schema", "schema": {"uniqueItems": True}}},
    ]  # fmt: skip
    manifest = photo.parent / "structured.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_id = f"structured-{time.monotonic_ns()}"
    done = run_cli(env, "backlog", str(manifest), "--run-id", run_id, "--wait", "--interval", "0.5",
                   "--timeout", "300", timeout=400)  # fmt: skip
    assert done.returncode == 1, done.stderr  # the two invalid lines
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["counts"] == {"succeeded": 2, "invalid": 2}
    assert "listed twice" in _errors(env, run_id)
    assert "'uniqueItems' is not enforced" in _errors(env, run_id)
    rows = {row["custom_id"]: row for row in _rows(env, run_id)}
    jsonschema.validate(rows["s-1"]["output"], REFUND)
    assert rows["s-2"]["output"] in CHOICES


def _rows(env: dict[str, str], run_id: str) -> list[dict[str, Any]]:
    from shared import names
    from shared.stores import open_run_files

    text = open_run_files(services.settings_from_env(env)).get_text(
        names.run_key("", run_id, "results.jsonl")
    )
    return [json.loads(line) for line in (text or "").splitlines()]


def _errors(env: dict[str, str], run_id: str) -> str:
    from shared import names
    from shared.stores import open_run_files

    return (
        open_run_files(services.settings_from_env(env)).get_text(names.run_key("", run_id, "errors.jsonl"))
        or ""
    )
