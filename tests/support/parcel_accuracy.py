"""The parcels model's accuracy through the whole system: fresh parcel photos submitted through mrc-api
(`POST /v1/jobs`) to real workers, answers read back from the result objects in S3.

One run asks, of every image: the three questions (colour, damage, digit) free, on every worker given
(one per quantization, each on its own Redis database so each gets only its own jobs); on the first
of them also the colour question with `choice` over the six colours, and the JSON prompt with
parcels.SCHEMA. Everything is submitted at once so each worker's engine batches it. Used by
tests/integration/test_parcel_accuracy.py (asserts) and tests/bench/bench_parcel_accuracy.py (prints).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from producer.client import Client
from producer.server import create_app
from scripts import devservices as services
from scripts import parcels
from shared import tenants

CHOICES = list(parcels.COLOURS)
FREE_TOKENS = 2  # the answer's one token and end-of-text
SCHEMA_TOKENS = 16  # the seven pieces of the JSON answer and end-of-text, with room to spare
KEY = "k-parcel-accuracy"
AUTH = {"Authorization": f"Bearer {KEY}"}
OWNER = hashlib.sha256(KEY.encode()).hexdigest()[:12]  # the key's namespace (shared/tenants.py)


@dataclass
class Run:
    """What was asked and what came back."""

    truths: list[parcels.Parcel]
    jobs: dict[str, tuple[str, str, int]] = field(default_factory=dict)  # job id -> (worker, kind, image)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0

    def answers(self, worker: str, kind: str) -> dict[int, dict[str, Any]]:
        return {i: self.results[j] for j, (w, k, i) in self.jobs.items() if (w, k) == (worker, kind)}

    def accuracy(self, worker: str, kind: str) -> float:
        """Share of right answers of one kind (free questions, `choice` or `json.<field>`)."""
        answers = self.answers(worker, kind.split(".")[0])
        right = sum(self._right(kind, result, self.truths[i]) for i, result in answers.items())
        return right / max(1, len(answers))

    @staticmethod
    def _right(kind: str, result: dict[str, Any], truth: parcels.Parcel) -> bool:
        if kind == "choice":
            return result.get("output") == truth.colour
        if kind.startswith("json."):
            output = result.get("output") or {}
            return bool(output.get(kind[5:]) == truth.as_json()[kind[5:]])
        return parcels.is_right(kind, result.get("text"), truth)

    def agreement(self, kind: str, one: str, other: str) -> float:
        """Share of images whose answers (text) are the same on two workers."""
        a, b = self.answers(one, kind), self.answers(other, kind)
        same = sum(a[i].get("text") == b[i].get("text") for i in a)
        return same / max(1, len(a))


def worker_env(env: dict[str, str], quantization: str, database: int) -> dict[str, str]:
    """The session's services, its own Redis database, the parcels model at one quantization."""
    base = env["MRC_REDIS_URL"].rsplit("/", 1)[0]
    return {
        **env,
        "MRC_REDIS_URL": f"{base}/{database}",
        "MRC_MODEL": "parcels",
        "MRC_QUANTIZATION": quantization,
        "MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(),
        "MRC_API_RATE_PER_S": "0",  # hundreds of submissions in a second, from one key
    }


@contextlib.contextmanager
def workers(envs: dict[str, dict[str, str]], folder: Path) -> Iterator[dict[str, services.Worker]]:
    """One worker per environment, started side by side; all stopped on exit."""
    with concurrent.futures.ThreadPoolExecutor(len(envs)) as pool:
        futures = {
            name: pool.submit(services.start_worker, e, folder / f"worker-{name}.log")
            for name, e in envs.items()
        }
        started = {}
        try:
            for name, future in futures.items():
                started[name] = future.result()
            yield started
        finally:
            for future in futures.values():
                if future.exception() is None:
                    future.result().stop()


def run(
    envs: dict[str, dict[str, str]], images: int, seed: int, widest: int = parcels.MAX_W, timeout: float = 600
) -> Run:
    """Ask every worker about `images` fresh photos (seeds from `seed`, no wider than `widest`); wait
    for every result."""
    drawn = [
        parcels.make(seed + i, parcels.sample_size(random.Random(seed + i), widest)) for i in range(images)
    ]
    outcome = Run([truth for _data, truth in drawn])
    first = next(iter(envs))
    client = Client(services.settings_from_env(envs[first]))
    tag = uuid.uuid4().hex[:8]
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        apis = {
            name: stack.enter_context(TestClient(create_app(services.settings_from_env(e))))
            for name, e in envs.items()
        }
        for i, (data, _truth) in enumerate(drawn):
            uri = _upload(client, data)
            for name, api in apis.items():
                for kind in parcels.KINDS:
                    body = {"prompt": parcels.question(seed + i, kind), "max_new_tokens": FREE_TOKENS}
                    outcome.jobs[_post(api, tag, name, kind, i, uri, body)] = (name, kind, i)
            for kind, body in _structured(seed + i).items():
                outcome.jobs[_post(apis[first], tag, first, kind, i, uri, body)] = (first, kind, i)
        outcome.results = _collect(apis, client, list(outcome.jobs), timeout)
    outcome.seconds = time.monotonic() - began
    return outcome


def _structured(seed: int) -> dict[str, dict[str, Any]]:
    """The constrained jobs of one photo: the colour question as a choice, and the JSON one."""
    return {
        "choice": {
            "prompt": parcels.question(seed, "colour"),
            "max_new_tokens": FREE_TOKENS,
            "response_format": {"type": "choice", "choices": CHOICES},
        },
        "json": {
            "prompt": parcels.JSON_PROMPT,
            "max_new_tokens": SCHEMA_TOKENS,
            "response_format": {"type": "json_schema", "schema": parcels.SCHEMA},
        },
    }


def _upload(client: Client, data: bytes) -> str:
    """Stored once as the key's own upload (every job of the photo names it; no other key may)."""
    uri, _digest = client.upload_bytes(data, OWNER)
    return uri


def _post(
    api: TestClient, tag: str, worker: str, kind: str, image: int, uri: str, body: dict[str, Any]
) -> str:
    job_id = f"acc-{tag}-{worker}-{kind}-{image}"
    reply = api.post(
        "/v1/jobs",
        json={"image": uri, "job_id": job_id, **body},
        headers=AUTH,
    )
    assert reply.status_code == 202, reply.text
    return job_id


def _collect(
    apis: dict[str, TestClient], client: Client, job_ids: list[str], timeout: float
) -> dict[str, Any]:
    """Every job's result object, read from S3 once its completion event is out (GET /v1/events)."""
    wanted = set(job_ids)
    found: dict[str, dict[str, Any]] = {}
    after = dict.fromkeys(apis, "0")
    deadline = time.monotonic() + timeout
    while wanted - found.keys():
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(wanted - found.keys())} of {len(wanted)} jobs have no result")
        for name, api in apis.items():
            reply = api.get("/v1/events", params={"after": after[name], "wait": 1}, headers=AUTH)
            assert reply.status_code == 200, reply.text
            after[name] = reply.json()["last_id"]
            for event in reply.json()["events"]:
                if event["job_id"] in wanted and event["job_id"] not in found:
                    result = client.result(tenants.job_id(OWNER, event["job_id"]))
                    assert result is not None, f"an event for {event['job_id']} but no result object"
                    found[event["job_id"]] = result
    return found
