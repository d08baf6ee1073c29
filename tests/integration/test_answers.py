"""Answers that say what happened (issue 36, items 4 and 5): a 503 means nothing was enqueued, so once
a job is queued every answer names it, and an SDK's retry of the same request is the same job; a
cancel that comes too late to stop anything is refused instead of ending `cancelling` -> `completed`."""

from __future__ import annotations

import base64
import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from producer.client import Client, Submission
from producer.openai.batch_book import RUNNING, BatchBook
from producer.server import create_app
from scripts import devservices as services
from shared import names
from shared.records import RedisJobRecords, connect
from tests.support import imagegen
from tests.support.api_server import serve
from tests.support.proxy import Proxy

pytestmark = pytest.mark.integration

KEY = "k-answers"
OWNER = hashlib.sha256(KEY.encode()).hexdigest()[:12]


@pytest.fixture
def cut_redis(workdir: Path) -> Iterator[tuple[services.Service, Proxy]]:
    """A Redis of this test's own, reached through a proxy that can be stopped and started again."""
    redis = services.start_redis(workdir / f"redis-answers-{uuid.uuid4().hex[:6]}")
    proxy = Proxy(redis.port, services.free_port())
    proxy.start()
    yield redis, proxy
    proxy.close()
    redis.stop()


def _queued(redis_url: str) -> int:
    client = redis_lib.Redis.from_url(redis_url)
    try:
        return sum(int(client.llen(key)) for key in names.queue_keys("interactive"))
    finally:
        client.close()


def test_a_client_wait_through_a_redis_that_hangs_finds_the_result_in_s3(
    env: dict[str, str], cut_redis: tuple[services.Service, Proxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (helper-50): with Redis hanging (not refusing), `mrc submit --wait --timeout 15` read the
    job's record for 10 s at a time, three retries over, and returned 69 s after its result was
    stored. The record is read on the hints' connection (short timeouts, no retries); S3 is looked at."""
    _redis, proxy = cut_redis
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    through = {**env, "MRC_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0", "MRC_CONNECT_TIMEOUT_S": "0.5"}
    client = Client(services.settings_from_env(through))
    job_id = f"hung-{uuid.uuid4().hex[:8]}"
    client.results.put_result(job_id, {"job_id": job_id, "status": "succeeded", "text": "yes"})
    proxy.hang()
    began = time.monotonic()
    try:
        assert client.wait(job_id, 8)["text"] == "yes"
        assert time.monotonic() - began < 8 + 12  # within its timeout and a read's slack (was 171 s)
    finally:
        proxy.unhang()
        client.close()


def test_redis_lost_after_the_push_answers_with_the_job_and_a_retry_is_the_same_job(
    env: dict[str, str], cut_redis: tuple[services.Service, Proxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 4: MRC_ENQUEUED, then Redis away during the wait, answered a 503 with no job id; the SDK
    retried and a second job ran. Now: 504 `answer_timeout` naming the job, no `x-should-retry:
    false` (the SDK may retry), and the same request again waits for the same job."""
    redis, proxy = cut_redis
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    api_env = {
        **env,
        "MRC_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0",
        "MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(),
        "MRC_OPENAI_WAIT_S": "4",
        "MRC_CONNECT_TIMEOUT_S": "0.5",
    }
    statuses: list[int] = []
    hooks = {"response": [lambda response: statuses.append(response.status_code)]}
    photo = imagegen.photo(64, 48, seed=71)
    url = f"data:image/jpeg;base64,{base64.b64encode(photo).decode()}"
    content = [{"type": "text", "text": "Refund?"}, {"type": "image_url", "image_url": {"url": url}}]
    messages: Any = [{"role": "user", "content": content}]
    answers: list[openai.APIStatusError] = []

    def ask(sdk: openai.OpenAI) -> None:
        try:
            sdk.chat.completions.create(model=env["MRC_MODEL"], messages=messages, max_tokens=3)
        except openai.APIStatusError as exc:
            answers.append(exc)

    with (
        serve(api_env) as base,
        httpx.Client(event_hooks=hooks, timeout=60) as http,
        openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, http_client=http) as sdk,
    ):
        asking = threading.Thread(target=ask, args=(sdk,))
        asking.start()
        services.wait_for(lambda: _queued(redis.url) == 1, 30, "the chat request's job to be queued")
        # Redis out of reach while the request waits for its answer (no worker runs it), to the end of
        # the wait: longer than redis-py's own retries ride out.
        proxy.stop()
        asking.join(60)
        proxy.start()
        ask(sdk)  # what the SDK's retry sends: the same bytes, no Idempotency-Key
    assert [a.status_code for a in answers] == [504, 504], [a.message for a in answers]
    assert 503 not in statuses
    first, again = (a.body for a in answers)
    assert isinstance(first, dict)
    assert isinstance(again, dict)
    assert first["code"] == "answer_timeout"
    assert first["job_id"] == again["job_id"]  # the retry waited for the same job ...
    assert answers[0].response.headers.get("x-mrc-job-id") == first["job_id"]
    assert answers[0].response.headers.get("x-should-retry") != "false"  # ... so the SDK may retry
    assert _queued(redis.url) == 1  # ... and queued nothing more


class _ConfirmFails(RedisJobRecords):
    """Redis answers the push, then fails the claim's confirmation (it went away in between)."""

    def confirm(self, job_id: str, token: str, checked: bool = True) -> bool:
        raise redis_lib.ConnectionError("Redis went away after the push")


def test_a_confirmation_lost_after_the_push_is_not_reported_as_nothing_enqueued(
    env: dict[str, str], client: Client, tmp_path: Path
) -> None:
    """Item 4's class: everything after the push that fails must not read as exit 5 / 503."""
    settings = services.settings_from_env(env)
    records = _ConfirmFails(connect(settings))
    sender = Client(settings, images=client.images, results=client.results, records=records)
    photo = tmp_path / "p.jpg"
    photo.write_bytes(imagegen.photo(48, 48, seed=72))
    job_id = f"confirm-{uuid.uuid4().hex[:8]}"
    job = sender.build_job(Submission(image=photo, prompt="Refund?", job_id=job_id, lane="backlog"))
    raw = redis_lib.Redis.from_url(env["MRC_REDIS_URL"])
    try:
        assert sender.enqueue(job) is True  # queued: said so, never raised as "not enqueued"
        assert client.records.pushed(names.job_push_id(job.job_id))
        # Its unconfirmed claim lapses (30 s; dropped here): the same submission again claims anew
        # and pushes nothing twice (the push's marker stands).
        raw.delete(names.job_key(job.job_id))
        assert sender.enqueue(job) is True
        assert client.records.pushed(names.job_push_id(job.job_id))
    finally:
        raw.close()
        sender.celery.close()


def test_a_cancel_too_late_to_stop_anything_is_refused_and_the_batch_completes(
    env: dict[str, str], client: Client
) -> None:
    """Item 5: a cancel while a batch was finalizing went `cancelling` -> `completed`, cancelled_at
    null. Now the start of finalizing and a cancel are one atomic choice: whichever comes second loses."""
    settings = services.settings_from_env(
        {**env, "MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(), "MRC_API_RATE_PER_S": "0"}
    )
    book = BatchBook(connect(settings))
    batch_id = f"batch_{uuid.uuid4().hex[:24]}"
    now = f"{time.time():.3f}"
    fields = {"id": batch_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
              "input_file_id": "file-x", "metadata": "{}", "created_at": now,
              "expires_at": f"{time.time() + 3600:.3f}", "status": "in_progress", "lines": "1",
              "api_key": OWNER}  # fmt: skip
    book.create(batch_id, OWNER, fields)
    # The keeper saw every request ended: finalizing wins ...
    assert book.move(batch_id, RUNNING, status="finalizing", finalizing_at=now)
    # ... so a cancel now moves nothing (and the one after a cancel could not finalize).
    assert not book.move(batch_id, RUNNING, ended_by="cancelled", status="cancelling")
    with TestClient(create_app(settings)) as api:
        auth = {"Authorization": f"Bearer {KEY}"}
        refused = api.post(f"/v1/batches/{batch_id}/cancel", headers=auth)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "conflict"
        after = api.get(f"/v1/batches/{batch_id}", headers=auth).json()
    assert (after["status"], after["cancelling_at"], after["cancelled_at"]) == ("finalizing", None, None)
    assert "ended_by" not in book.get(batch_id)
    # The other order: a cancel first, then the keeper's finalizing loses.
    other = f"batch_{uuid.uuid4().hex[:24]}"
    book.create(other, OWNER, {**fields, "id": other})
    assert book.move(other, RUNNING, ended_by="cancelled", status="cancelling", cancelling_at=now)
    assert not book.move(other, RUNNING, status="finalizing", finalizing_at=now)
    assert book.get(other)["status"] == "cancelling"
    # Nor does the enqueue's `validating` -> `in_progress` (Runner._started) put itself over it.
    assert not book.move(other, ("validating",), status="in_progress", in_progress_at=now)
    assert book.get(other)["status"] == "cancelling"
