"""/healthz means something: 503 while the consumer makes no progress with work in hand, 200 when
idle (however long) and again once it moves."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from producer.client import Client
from scripts import devservices as services
from tests.faults.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _healthz(worker: services.Worker) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_healthz_is_503_while_a_batch_is_stuck_and_200_when_idle_or_moving(cluster: Cluster) -> None:
    worker = cluster.echo_worker(MRC_STUCK_AFTER_S="3")  # liveness is the pipeline's, not the model's
    services.wait_for(lambda: bool(worker.find("MRC_CONSUMING")), 120, "consuming", worker.proc)
    time.sleep(4)  # idle for longer than the threshold, nothing to do: not stuck
    status, body = _healthz(worker)
    assert status == 200, body

    # The producer talks to S3 directly; the worker's S3 (through the proxy) stops answering.
    direct = Client(services.settings_from_env({**cluster.env, "MRC_S3_ENDPOINT_URL": cluster.s3.url}))
    (job,) = cluster.jobs(1)
    cluster.proxy.hang()
    assert direct.enqueue(job)
    services.wait_for(lambda: _healthz(worker)[0] == 503, 30, "/healthz to say stuck", worker.proc)
    status, body = _healthz(worker)
    assert body["status"] == "stuck"
    assert "batch" in body["reason"]

    cluster.proxy.unhang()
    assert direct.wait(job.job_id, 120)["status"] == "succeeded"
    status, body = _healthz(worker)
    assert status == 200, body
