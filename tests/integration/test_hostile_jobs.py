"""Job content that used to stop workers, through every door, against the session's real worker.

A lone surrogate ("\\ud83d": half an emoji, as a JavaScript client sends after cutting one) anywhere
in a job is refused at submission (CLI, API, manifest line); one that arrives anyway, in a message
from another producer, fails its own job with a stored result and the worker goes on. A schema whose
grammar reaches a dead end fails its job as `invalid_job`, never `model_error`: jobs in a row past the
failure streak leave the worker running. A manifest line nested deeper than any parser goes is an
invalid line; the other lines run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from producer.client import Client
from producer.server import create_app
from scripts import devservices as services
from scripts.devservices import Worker, run_cli
from shared.celery_app import send_job
from tests.support import imagegen

pytestmark = pytest.mark.integration

HALF_EMOJI = "\ud83d"
KEY = "k-hostile"


@pytest.fixture
def photo(tmp_path: Path) -> Path:
    path = tmp_path / "parcel.jpg"
    path.write_bytes(imagegen.photo(96, 64, seed=7))
    return path


def _refused_by_cli(env: dict[str, str], photo: Path, *flags: str) -> str:
    done = run_cli(env, "submit", "--image", str(photo), *flags)
    assert done.returncode == 2, (flags, done.stdout, done.stderr)
    assert done.stdout == ""
    return done.stderr


def test_text_no_store_could_write_is_refused_at_every_door(
    env: dict[str, str], client: Client, photo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = json.dumps({"type": "string", "description": HALF_EMOJI}, ensure_ascii=True)
    assert "not valid Unicode" in _refused_by_cli(env, photo, "--prompt", "Refund?", "--json-schema", schema)
    # Bytes that are not UTF-8 reach Python's argv as lone surrogates too.
    assert "not valid Unicode" in _refused_by_cli(
        env, photo, "--prompt", "Refund?", "--ticket-id", "T-\udcff"
    )
    assert "not valid Unicode" in _refused_by_cli(env, photo, "--prompt", "Refund \udcff?")
    assert "not valid Unicode" in _refused_by_cli(env, photo, "--prompt", "x", "--choice", "ok,n\udcffo")

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    api_env = {**env, "MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(), **services.shared_inputs(env)}
    image_uri = client.upload_image(photo)[0]
    with TestClient(create_app(services.settings_from_env(api_env))) as api:
        for body in (
            {"image": image_uri, "prompt": f"Refund? {HALF_EMOJI}"},
            {"image": image_uri, "prompt": "Refund?", "ticket_id": HALF_EMOJI},
            {"image": image_uri, "prompt": "Refund?",
             "response_format": {"type": "json_schema", "schema": {"type": "string", "title": HALF_EMOJI}}},
        ):  # fmt: skip
            raw = json.dumps(body, ensure_ascii=True)  # "\ud83d" on the wire, as a JS client writes it
            reply = api.post(
                "/v1/jobs",
                content=raw,
                headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            )
            assert reply.status_code == 422, reply.text
            assert reply.json()["error"]["code"] == "invalid_job"
            assert "not valid Unicode" in reply.json()["error"]["message"]

    manifest = tmp_path / "m.jsonl"
    lines = [
        json.dumps(
            {"custom_id": f"c{HALF_EMOJI}", "image": str(photo), "prompt": "Refund?"}, ensure_ascii=True
        ),
        json.dumps({"custom_id": "ok", "image": str(photo), "prompt": "Refund?"}),
        "[" * 30000 + "]" * 30000,  # nested past any parser: an invalid line, the others run
    ]
    manifest.write_text("\n".join(lines) + "\n")
    done = run_cli(env, "backlog", str(manifest), "--run-id", "hostile-1", "--strict")
    assert done.returncode == 2, done.stderr
    assert "2 invalid line(s)" in done.stderr
    assert "not valid Unicode" in done.stderr
    assert "nested" in done.stderr


def test_text_no_store_could_write_is_a_400_on_the_openai_doors_never_a_500(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat and batch bodies: a lone surrogate in a model name, an image URL (its host, its path,
    an s3:// key), a message or a batch's file id is refused by name (review: the URL refusals and the
    batch's file lookup quoted it into a 500). No error path fails to write what it quotes."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    api_env = {
        **env,
        "MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(),
        "MRC_IMAGE_URL_HOSTS": "localhost",
    }

    def chat(model: str, part: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}, part]}],
        }

    def url(where: str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": where}}

    bodies = [
        ("/v1/chat/completions", chat(HALF_EMOJI, {"type": "text", "text": "Refund?"})),
        ("/v1/chat/completions", chat("tiny", url("http://\udcff.localhost/x.jpg"))),
        ("/v1/chat/completions", chat("tiny", url("http://localhost:9/\udcff.jpg"))),
        ("/v1/chat/completions", chat("tiny", url(f"s3://{env['MRC_S3_BUCKET']}/inputs/\udcff.jpg"))),
        ("/v1/chat/completions", chat("tiny", {"type": "text", "text": f"Refund {HALF_EMOJI}?"})),
        ("/v1/batches", {"input_file_id": "file-\udcff", "endpoint": "/v1/chat/completions",
                         "completion_window": "24h"}),
        ("/v1/batches", {"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                         "completion_window": "24h", "metadata": {"k": HALF_EMOJI}}),
    ]  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with TestClient(create_app(services.settings_from_env(api_env)), raise_server_exceptions=False) as api:
        for path, body in bodies:
            raw = json.dumps(body, ensure_ascii=True).replace("\\\\udcff", "\\udcff")
            reply = api.post(path, content=raw, headers=headers)
            assert reply.status_code == 400, (path, body, reply.text)
            error = reply.json()["error"]
            assert error["code"] == "invalid_value", error
            assert "not valid Unicode" in error["message"], error
        # A multipart header may name its charset; utf-7's "+3P8-" decodes to a lone surrogate (review:
        # the upload was stored, then it and every listing of the key's files answered 500).
        line = json.dumps(
            {
                "custom_id": "c1",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            }
        )
        form = (
            b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
            b'Content-Disposition: form-data; name="file"; filename="+3P8-.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n" + line.encode() + b"\r\n--B--\r\n"
        )
        sent = api.post(
            "/v1/files",
            content=form,
            headers={
                "Authorization": f"Bearer {KEY}",
                "Content-Type": "multipart/form-data; boundary=B; charset=utf-7",
            },
        )
        assert sent.status_code == 200, sent.text
        assert sent.json()["filename"] == "\ufffd.jsonl"
        listed = api.get("/v1/files", headers=headers)
        assert listed.status_code == 200, listed.text
        assert sent.json()["id"] in [f["id"] for f in listed.json()["data"]]
        assert api.get(f"/v1/files/{sent.json()['id']}", headers=headers).status_code == 200
        for path in ("/v1/files/file-%ED%B3%BF", "/v1/batches/batch_%ED%B3%BF", "/v1/jobs/%ED%B3%BF",
                     "/v1/files/file-%ED%B3%BF/content"):  # fmt: skip
            reply = api.get(path, headers=headers)
            assert reply.status_code == 404, (path, reply.text)


def _result(client: Client, job_id: str) -> dict[str, Any]:
    return client.wait(job_id, 180)


def test_a_hostile_message_from_another_producer_fails_alone_and_the_worker_goes_on(
    client: Client, worker: Worker, photo: Path
) -> None:
    uri = client.upload_image(photo)[0]
    hostile = {
        "job_id": "hostile-surrogate",
        "image_uri": uri,
        "prompt": "Refund?",
        "max_new_tokens": 4,
        "ticket_id": f"T-{HALF_EMOJI}",
        "response_format": {"type": "json_schema", "schema": {"type": "string", "description": HALF_EMOJI}},
    }
    send_job(client.celery, hostile, "interactive")  # past every producer check
    deep: Any = "x"
    for _ in range(80):
        deep = [deep]
    send_job(
        client.celery,
        {**hostile, "job_id": "hostile-deep", "ticket_id": "T-1", "prompt": deep},
        "interactive",
    )
    fine = client.submit(photo, "Refund?", max_new_tokens=4)
    for job_id in ("hostile-surrogate", "hostile-deep"):
        result = _result(client, job_id)
        assert result["status"] == "failed"
        assert result["error"]["code"] == "invalid_job", result["error"]
    assert _result(client, fine)["status"] == "succeeded"
    assert worker.proc.poll() is None, "the worker stopped"


def test_schemas_whose_grammar_dead_ends_fail_as_the_jobs_own_and_never_stop_the_worker(
    env: dict[str, str], client: Client, worker: Worker, photo: Path
) -> None:
    """Refused at submission; six in a row from another producer (past MRC_MODEL_FAILURE_STREAK, 5,
    which counts model errors only) each fail as invalid_job by the same rule at the worker's first look
    (a grammar that dead-ends while generating fails its row the same way: test_schema_rules.py), and
    the worker goes on."""
    dead_end = {"type": "json_schema", "schema": {"type": "string", "pattern": "a[^\\s\\S]"}}
    assert "negated class" in _refused_by_cli(
        env, photo, "--prompt", "x", "--json-schema", json.dumps(dead_end["schema"])
    )
    uri = client.upload_image(photo)[0]
    ids = [f"dead-end-{i}" for i in range(6)]
    for job_id in ids:
        message = {"job_id": job_id, "image_uri": uri, "prompt": "Refund?", "max_new_tokens": 8}
        send_job(client.celery, {**message, "response_format": dead_end}, "interactive")
    for job_id in ids:
        result = _result(client, job_id)
        assert result["status"] == "failed"
        assert result["error"]["code"] == "invalid_job"
        assert "negated class" in result["error"]["message"]
    assert _result(client, client.submit(photo, "Refund?", max_new_tokens=4))["status"] == "succeeded"
    assert worker.proc.poll() is None, "the worker stopped"
    assert not worker.find("MRC_FATAL")


def test_a_schema_or_image_path_that_is_no_regular_file_is_refused_before_it_is_read(
    env: dict[str, str], photo: Path, tmp_path: Path
) -> None:
    """Review, helper-84: `--json-schema /dev/zero` read until the kernel killed `mrc` at 22 GB, a FIFO
    blocked it for good, and `--image /dev/zero` said the file was not found. Exit 2, saying why."""
    fifo = tmp_path / "schema.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    huge.write_text("{" + " " * (2 << 20) + "}")
    missing = tmp_path / "none.json"
    for path, why in (
        ("/dev/zero", "not a regular file"),
        (str(fifo), "not a regular file"),
        (str(huge), "is over 1048576 bytes"),
        (str(missing), "neither inline JSON"),
    ):
        assert why in _refused_by_cli(env, photo, "--prompt", "x", "--json-schema", path), path
    small = tmp_path / "schema.json"
    small.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}, indent=2))
    done = run_cli(env, "submit", "--image", "/dev/zero", "--prompt", "x", "--json-schema", str(small))
    assert done.returncode == 2, done.stderr
    assert "image path is not a regular file: /dev/zero" in done.stderr
