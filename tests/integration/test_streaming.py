"""Streamed chat answers (`stream: true`) through the official `openai` SDK and raw HTTP, against a
real worker: the chunks join into the plain answer, the worker publishes the text as it decodes it,
a client that leaves cancels nothing, and every way a stream can end badly says so in OpenAI's shape
(before the first byte when nothing was queued, as an error event naming the job after)."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from producer.client import Client
from scripts import devservices as services
from shared import names, tenants
from shared.records import connect
from tests.support import imagegen
from tests.support.api_server import api_env, serve

pytestmark = pytest.mark.integration

KEY = "k-stream"
KEY_ID = hashlib.sha256(KEY.encode()).hexdigest()[:12]


@pytest.fixture(scope="module")
def stream_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    with api_env(env, MRC_API_KEYS=hashlib.sha256(KEY.encode()).hexdigest(), MRC_API_RATE_PER_S="0") as ready:
        yield ready


@pytest.fixture(scope="module")
def base_url(stream_env: dict[str, str], worker: services.Worker) -> Iterator[str]:
    with serve(stream_env) as url:
        yield url


@pytest.fixture(scope="module")
def sdk(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(stream_env: dict[str, str]) -> str:
    return stream_env["MRC_MODEL"]  # listed as an alias of what the workers serve, at once


def ask(text: str, seed: int, data: bytes | None = None) -> list[Any]:
    image = data if data is not None else imagegen.photo(96, 64, seed=seed)
    url = f"data:image/jpeg;base64,{base64.b64encode(image).decode()}"
    return [
        {"role": "system", "content": "You inspect parcels for a courier's complaints desk."},
        {
            "role": "user",
            "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
        },
    ]


def test_the_streamed_chunks_join_into_the_plain_answer_with_its_usage(
    sdk: openai.OpenAI, model: str, stream_env: dict[str, str]
) -> None:
    messages = ask("Can I get a refund for this parcel?", seed=61)
    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # Asked second, the plain request is answered from the result cache: the same answer.
    plain = sdk.chat.completions.create(model=model, messages=messages, max_tokens=24)  # type: ignore[arg-type]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].id != plain.id  # another request (stream differs): another job
    assert {c.model for c in chunks} == {plain.model}  # the served model's name, as the plain answer
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [plain.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert plain.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        plain.usage.prompt_tokens,
        plain.usage.completion_tokens,
    )
    assert all(c.usage is None for c in chunks[:-1])
    # The worker published the text as it decoded it: the job's stream holds it, from offset 0.
    redis = connect(services.settings_from_env(stream_env))
    entries = redis.xrange(names.stream_key(tenants.job_id(KEY_ID, chunks[0].id)))
    redis.close()
    published = ""
    for _id, fields in entries:
        assert int(fields["at"]) == len(published)
        published += fields["t"]
    assert entries[-1][1].get("end") == "1"
    assert published == text
    assert {fields.get("m") for _id, fields in entries} == {plain.model}  # as the result names it


def test_a_client_that_leaves_mid_stream_cancels_nothing(
    base_url: str, model: str, client: Client, stream_env: dict[str, str]
) -> None:
    body = {"model": model, "messages": ask("Is the label torn?", seed=62), "max_tokens": 48, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        job_id = response.headers["x-mrc-job-id"]
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # the role chunk has been read: the client goes away now
    stored = tenants.job_id(KEY_ID, job_id)
    result = _wait(client, stored)
    assert result["status"] == "succeeded"
    assert result["usage"]["completion_tokens"] >= 1


def _wait(client: Client, job_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (result := client.result(job_id)) is None:
        assert time.monotonic() < deadline, f"no result for {job_id}"
        time.sleep(0.2)
    return result


def test_a_job_that_fails_ends_its_stream_with_an_error_event_naming_it(
    sdk: openai.OpenAI, model: str
) -> None:
    broken = ask("Refund?", seed=0, data=imagegen.truncated_jpeg())  # passes the intake, fails decoding
    stream = sdk.chat.completions.create(model=model, messages=broken, max_tokens=8, stream=True)  # type: ignore[arg-type]
    seen: list[Any] = []
    with pytest.raises(openai.APIError) as failed:
        seen.extend(stream)
    assert seen
    assert seen[0].choices[0].delta.role == "assistant"  # the stream had begun
    assert "image_decode_error" in failed.value.message
    assert seen[0].id in failed.value.message


def test_a_stream_that_cannot_start_answers_json_and_one_that_waits_too_long_an_error_event(
    stream_env: dict[str, str], model: str
) -> None:
    down = {
        **stream_env,
        "MRC_REDIS_URL": f"redis://127.0.0.1:{services.free_port()}/0",
        "MRC_CONNECT_TIMEOUT_S": "0.5",
    }
    with serve(down) as url, httpx.Client(timeout=30) as http:
        body = {"model": model, "messages": ask("Refund?", seed=63), "stream": True}
        refused = http.post(
            f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        )
    assert refused.status_code == 503  # nothing was queued: said before the first byte, as JSON
    assert refused.headers["content-type"].startswith("application/json")
    assert refused.json()["error"]["type"] == "server_error"
    # A database no worker reads: the job stays queued, the wait runs out mid-stream.
    idle = {
        **stream_env,
        "MRC_REDIS_URL": stream_env["MRC_REDIS_URL"].rsplit("/", 1)[0] + "/7",
        "MRC_OPENAI_WAIT_S": "1.5",
    }
    with serve(idle) as url, openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as sdk:
        stream = sdk.chat.completions.create(model=model, messages=ask("Refund?", seed=64), stream=True)  # type: ignore[arg-type]
        seen: list[Any] = []
        with pytest.raises(openai.APIError) as timed_out:
            seen.extend(stream)
    assert [c.choices[0].delta.role for c in seen] == ["assistant"]
    assert "answer_timeout" in str(timed_out.value.body) or "no answer within" in timed_out.value.message
    assert seen[0].id in timed_out.value.message


def test_keep_alives_come_within_the_sdks_read_timeout(stream_env: dict[str, str], model: str) -> None:
    """Review, helper-98: a client told to give up after 4 s of silence (`OpenAI(timeout=4)`, sent as
    `x-stainless-read-timeout`) got its first keep-alive after 10 s and gave up, and the SDK does not
    retry once a stream's headers came. Keep-alives now come twice within the client's timeout: the
    stream lasts until its own deadline (a database no worker reads: the job stays queued)."""
    idle = {
        **stream_env,
        "MRC_REDIS_URL": stream_env["MRC_REDIS_URL"].rsplit("/", 1)[0] + "/7",
        "MRC_OPENAI_WAIT_S": "6",
    }
    with (
        serve(idle) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=2.0) as sdk,
    ):
        stream = sdk.chat.completions.create(model=model, messages=ask("Refund?", seed=68), stream=True)  # type: ignore[arg-type]
        with pytest.raises(openai.APIError) as ended:
            list(stream)
    assert not isinstance(ended.value, openai.APITimeoutError), ended.value
    assert "answer_timeout" in str(ended.value.body) or "no answer within" in ended.value.message


def test_keep_alive_comments_and_the_events_are_plain_sse(base_url: str, model: str) -> None:
    """What a client without the SDK reads: `data:` lines, a role chunk first, `[DONE]` last."""
    body = {"model": model, "messages": ask("Refund?", seed=65), "max_tokens": 4, "stream": True}
    with httpx.Client(timeout=60) as http:
        raw = http.post(
            f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ).text
    events = [block for block in raw.split("\n\n") if block.strip()]
    assert all(e.startswith(("data: ", ":")) for e in events), events
    data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    first = json.loads(data[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(data[-2])["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_structured_answer_streams_its_json_text(sdk: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"refund": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 12}},
        "required": ["refund", "reason"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "claim", "schema": schema}}
    messages = ask("Refund or not, and why?", seed=66)
    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=40,
            response_format=fmt,
            stream=True,  # type: ignore[arg-type]
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = json.loads(text)
    assert set(answer) == {"refund", "reason"}
    plain = sdk.chat.completions.create(model=model, messages=messages, max_tokens=40, response_format=fmt)  # type: ignore[arg-type]
    assert plain.choices[0].message.content == text


def test_a_redis_that_hangs_mid_stream_still_ends_it_at_its_deadline_with_keep_alives(
    stream_env: dict[str, str], model: str, tmp_path: Path
) -> None:
    """Review finding: a Redis that stops answering (SIGSTOP, not dead) held a stream 15 s past its
    deadline in silence, each read waiting out a 10 s socket timeout. Now the reads run beside the
    clock: the error event comes at the deadline (a job on a Redis no worker reads stays queued)."""
    import signal

    redis = services.start_redis(tmp_path / "redis")
    env = {**stream_env, "MRC_REDIS_URL": redis.url, "MRC_OPENAI_WAIT_S": "3"}
    body = {"model": model, "messages": ask("Refund?", seed=67), "stream": True}
    try:
        with serve(env) as url, httpx.Client(timeout=60) as http:
            began = time.monotonic()
            with http.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as response:
                lines = response.iter_lines()
                assert next(lines).startswith(":")  # the stream is open (the job waits in the queue)
                redis.proc.send_signal(signal.SIGSTOP)
                rest = [line for line in lines if line.startswith("data: ")]
            took = time.monotonic() - began
    finally:
        redis.proc.send_signal(signal.SIGCONT)
        redis.stop()
    assert json.loads(rest[-1][6:])["error"]["code"] == "answer_timeout"
    assert took < 3 + 8, f"the stream ended {took:.1f} s after it began (deadline 3 s)"  # was ~20 s late


def test_every_chunk_names_the_model_the_worker_serves_whatever_the_request_named(
    stream_env: dict[str, str], model: str, tmp_path: Path
) -> None:
    """Review finding (a flaky run): a stream's chunks named `tiny`, the name asked for, when the API
    had seen no loaded worker's heartbeat yet, and the plain answer `tiny-fuyu-v1`. The role chunk now
    waits for the worker's first text, which names the model. Here the test writes that text as a
    worker does (workers/streaming.py's RedisSink), on a Redis no worker reads: the API knows no
    served model but the one the stream names."""
    from workers.streaming import Entry, RedisSink

    redis = services.start_redis(tmp_path / "redis")
    env = {**stream_env, "MRC_REDIS_URL": redis.url, "MRC_OPENAI_WAIT_S": "30"}
    body = {"model": model, "messages": ask("Refund?", seed=68), "stream": True}
    try:
        with (
            serve(env) as url,
            httpx.Client(timeout=60) as http,
            http.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as response,
        ):
            assert response.status_code == 200
            stored = tenants.job_id(KEY_ID, response.headers["x-mrc-job-id"])
            lines = response.iter_lines()
            assert next(lines).startswith(":")  # open; nothing names the model yet
            client = connect(services.settings_from_env(env))
            RedisSink(client, 60, "served-name").write([Entry(stored, 0, "The parcel")], {stored})
            client.close()
            data = [json.loads(line[6:]) for line in _first(lines, 2)]
    finally:
        redis.stop()
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data[1]["choices"][0]["delta"] == {"content": "The parcel"}
    assert [chunk["model"] for chunk in data] == ["served-name", "served-name"]


def _first(lines: Iterator[str], count: int) -> list[str]:
    out: list[str] = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line)
            if len(out) == count:
                break
    return out


def test_a_stream_that_ends_before_any_text_names_the_served_model_not_a_loading_workers(
    stream_env: dict[str, str], model: str, tmp_path: Path
) -> None:
    """Review, helper-79: a stream that timed out named `tiny` (the name asked) while a worker was
    loading beside one serving `tiny-fuyu-v1`: the loading worker's heartbeat names the model as asked.
    Heartbeats as the workers write them (workers/heartbeat.py), on a Redis no worker reads."""
    from workers.heartbeat import Heartbeat

    redis = services.start_redis(tmp_path / "redis")
    env = {**stream_env, "MRC_REDIS_URL": redis.url, "MRC_OPENAI_WAIT_S": "1.5"}
    client = connect(services.settings_from_env(env))
    serving = {"hostname": "a", "lanes": ["interactive"], "model": "served-name", "quantization": "nf4"}
    loading = {"hostname": "b", "lanes": ["interactive"], "model": model, "loaded": False, "ready": False}
    other = {**loading, "hostname": "c", "model": "parcels"}  # loading a model no other worker serves
    Heartbeat(client, "a", lambda: serving).beat()
    Heartbeat(client, "b", lambda: loading).beat()
    Heartbeat(client, "c", lambda: other).beat()
    body = {"model": model, "messages": ask("Refund?", seed=69), "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        with serve(env) as url, httpx.Client(timeout=60) as http:
            raw = http.post(f"{url}/v1/chat/completions", json=body, headers=auth).text
            # Still a name a request may give (review, helper-80: 404 while its worker loaded).
            assert http.get(f"{url}/v1/models/parcels", headers=auth).status_code == 200
    finally:
        client.close()
        redis.stop()
    data = [json.loads(block[6:]) for block in raw.split("\n\n") if block.startswith("data: ")]
    assert data[0]["choices"][0]["delta"]["role"] == "assistant"
    assert data[0]["model"] == "served-name"
    assert data[-1]["error"]["code"] == "answer_timeout"
