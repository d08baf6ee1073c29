"""What a chat's answer asks of S3 from mrc-api: the photo's upload and, once the job ended, its result.
Counted at a proxy in front of the session's S3 endpoint that only mrc-api talks through (the
worker reaches S3 directly)."""

from __future__ import annotations

import base64
import hashlib
import uuid

import httpx
import pytest

from scripts import devservices as services
from tests.support import imagegen
from tests.support.api_server import api_env, serve
from tests.support.slow_proxy import SlowProxy

pytestmark = pytest.mark.integration

KEY = "k-chat-s3-requests"


def test_a_chat_answer_reads_its_result_from_s3_once_it_ended_and_never_before(
    env: dict[str, str], worker: services.Worker
) -> None:
    """A chat's wait read S3 first, before the worker could have begun: one GET of a result that
    could not be there yet, every time (a fifth of a chat's S3 requests, and one more round trip on
    the API's side)."""
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
            job = reply.headers["x-mrc-job-id"].split("~")[-1]
            assert [(method, path.split("/")[2]) for method, path in asked] == [
                ("PUT", "inputs"),
                ("GET", "results"),
            ], asked
            assert job in asked[1][1]
    finally:
        proxy.stop()
