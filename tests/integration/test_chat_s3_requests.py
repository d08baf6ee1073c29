"""What a ticket's answer asks of S3 from mrc-api and from `Client.wait`: a chat's, the photo's upload
alone (its result is read from the copy the worker keeps beside the job's record, shared/records.py
ANSWER_TTL_S); a wait on a backlog job, its result from S3. Counted at a proxy in front of the
session's S3 endpoint that only mrc-api talks through (the worker reaches S3 directly), and by the
client's own reads."""

from __future__ import annotations

import base64
import hashlib
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts import devservices as services
from tests.support import imagegen
from tests.support.api_server import api_env, serve
from tests.support.slow_proxy import SlowProxy

pytestmark = pytest.mark.integration

KEY = "k-chat-s3-requests"


def test_a_chat_answer_asks_s3_only_to_store_its_photo(env: dict[str, str], worker: services.Worker) -> None:
    """A chat's wait read S3 first, before the worker could have begun: one GET of a result that
    could not be there yet, every time; and once the job ended it read the result from S3, one more
    round trip at the end of every ticket."""
    proxy = SlowProxy(int(env["MRC_S3_ENDPOINT_URL"].rsplit(":", 1)[1]), 0.0).start()
    keys = {"MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(), "MRC_API_RATE_PER_S": "0"}
    try:
        with (
            api_env(env, MRC_S3_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}", **keys) as through_proxy,
            serve(through_proxy) as url,
            httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http,
        ):
            for _turn in range(2):  # the first also makes the bucket's acquaintance
                photo = base64.b64encode(imagegen.photo(64, 48, seed=uuid.uuid4().int % 10_000)).decode()
                content = [
                    {"type": "text", "text": "Is it damaged?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{photo}"}},
                ]
                body = {"model": env["MRC_MODEL"], "messages": [{"role": "user", "content": content}],
                        "max_tokens": 2}  # fmt: skip
                del proxy.requests[:]
                reply = http.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
            asked = [tuple(line.split(" ")[:2]) for line in proxy.requests]
            assert [(method, path.split("/")[2]) for method, path in asked] == [("PUT", "inputs")], asked
            assert reply.json()["choices"][0]["message"]["content"] is not None
    finally:
        proxy.stop()


def test_a_wait_reads_a_tickets_result_beside_its_record_and_a_backlog_jobs_from_s3(
    env: dict[str, str], worker: services.Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from producer.client import Client
    from producer.intake.request import Submission

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    reads: list[str] = []

    class Counting(Client):
        def result(self, job_id: str) -> dict[str, Any] | None:
            reads.append(job_id)
            return super().result(job_id)

    client = Counting(services.settings_from_env(env))
    photo = tmp_path / "p.jpg"
    photo.write_bytes(imagegen.photo(64, 48, seed=7))
    stored = {}
    for lane in ("interactive", "backlog"):
        job = client.build_job(Submission(image=photo, prompt="Is it damaged?", lane=lane, max_new_tokens=2))
        assert client.enqueue(job, minted=True)
        stored[lane] = client.wait(job.job_id, 120)
        assert stored[lane] == client.results.get_result(job.job_id)  # the same object S3 holds
    assert len(reads) == 1, reads  # the backlog job's; the ticket's came with its record
    assert stored["backlog"]["job_id"] == reads[0]
