"""A worker that must run a fast attention kernel and does not, refuses to become ready."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scripts import devservices as services

pytestmark = pytest.mark.integration


def test_required_fast_attention_refuses_readiness_on_eager(env: dict[str, str], tmp_path: Path) -> None:
    """Not ready, and seen so: `mrc queues` (and the ops page, from the same heartbeat) lists it with
    its reason, also while it loads its model (review, helper-74: neither showed it at all)."""
    log = tmp_path / "worker.log"
    hostname = f"refuses-{tmp_path.name[-8:]}"
    worker_env = {
        **env,
        "MRC_ATTENTION": "eager",
        "MRC_REQUIRE_FAST_ATTENTION": "true",
        "MRC_QUANTIZATION": "fp32",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(services.BIN / "mrc-worker"), "--hostname", hostname],
            env=worker_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = services.Worker(proc, log, worker_env)
    try:
        services.wait_for(lambda: bool(worker.find("MRC_NOT_READY")), 120, "MRC_NOT_READY", proc)
        assert "'math'" in worker.find("MRC_NOT_READY")[0]["reason"]
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/readyz")
        assert caught.value.code == 503
        assert json.loads(caught.value.read())["status"] == "not_ready"
        assert not worker.find("MRC_WORKER_READY")
        shown = {
            w["hostname"]: w for w in json.loads(services.run_cli(env, "queues", "--json").stdout)["workers"]
        }
        assert shown[hostname]["ready"] is False
        assert "is not a fast kernel" in shown[hostname]["not_ready_reason"]
        line = next(x for x in services.run_cli(env, "queues").stdout.splitlines() if hostname in x)
        assert f"worker {hostname}, not ready: attention kernel" in line
    finally:
        assert worker.stop(signal.SIGTERM) == 0
    listed = json.loads(services.run_cli(env, "queues", "--json").stdout)["workers"]
    assert hostname not in {w["hostname"] for w in listed}, "a stopped worker's entry stays"


def test_the_backend_is_chosen_from_settings(env: dict[str, str], tmp_path: Path) -> None:
    """MRC_MODEL=echo: a worker with no model at all (the broker benchmarks' worker), same path."""
    from tests.support import imagegen

    redis = services.start_redis(tmp_path / "redis")  # its own queue: no other worker takes the job
    env = {**env, "MRC_MODEL": "echo", "MRC_REDIS_URL": redis.url}
    worker = services.start_worker(env, tmp_path / "echo.log")
    try:
        assert worker.find("MRC_WORKER_READY")[0]["model"] == "echo"
        image = tmp_path / "e.jpg"
        image.write_bytes(imagegen.photo(90, 60))
        job_id = f"echo-{tmp_path.name[-8:]}"
        done = services.run_cli(
            env, "submit", "--image", str(image), "--prompt", "echo me", "--job-id", job_id,
            "--wait", "--timeout", "60",
        )  # fmt: skip
        result = json.loads(done.stdout)
        assert result["text"] == "90x60: echo me"
        assert result["model"]["id"] == "echo"
    finally:
        worker.stop()
        redis.stop()
