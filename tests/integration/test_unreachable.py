"""Redis or S3 out of reach, and settings that cannot work: one clear line and the contract's exit
code, within a few seconds, never a traceback and never a job reported as failed."""

from __future__ import annotations

import subprocess
import time

import pytest

from scripts import devservices as services

pytestmark = pytest.mark.integration


def _dead_url(scheme: str) -> str:
    return f"{scheme}://127.0.0.1:{services.free_port()}"  # nothing listens there


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if not line.startswith("MRC_UNKNOWN_SETTING")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ("submit", "--image", "s3://mrc-test/inputs/x.jpg", "--prompt", "refund?"),
        ("status", "some-job"),
        ("queues", "--json"),
        ("dlq", "list"),
    ],
)
def test_redis_unreachable_is_exit_5_naming_redis(env: dict[str, str], args: tuple[str, ...]) -> None:
    began = time.monotonic()
    done = services.run_cli({**env, "MRC_REDIS_URL": _dead_url("redis") + "/0"}, *args, timeout=30)
    assert done.returncode == 5, done.stderr
    assert "Redis" in _one_line(done.stderr)
    assert done.stdout == ""
    assert time.monotonic() - began < 15


@pytest.mark.parametrize(
    "args",
    [("submit", "--image", "s3://mrc-test/inputs/x.jpg", "--prompt", "refund?"), ("result", "some-job")],
)
def test_s3_unreachable_is_exit_5_naming_s3(
    env: dict[str, str], redis_service: services.Service, args: tuple[str, ...]
) -> None:
    began = time.monotonic()
    done = services.run_cli({**env, "MRC_S3_ENDPOINT_URL": _dead_url("http")}, *args, timeout=30)
    assert done.returncode == 5, done.stderr
    assert "S3" in _one_line(done.stderr)
    assert time.monotonic() - began < 15


def _worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(services.BIN / "mrc-worker")], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_worker_start_with_redis_unreachable_is_exit_5(env: dict[str, str]) -> None:
    done = _worker({**env, "MRC_REDIS_URL": _dead_url("redis")})
    assert done.returncode == 5
    assert "Redis" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MRC_MODEL_BATCH_MAX_JOBS", "0"),
        ("MRC_MAX_ATTEMPTS", "0"),
        ("MRC_FETCH_THREADS", "-2"),
        ("MRC_LOG_LEVEL", "CHATTY"),
        ("MRC_METRICS_PORT", "70000"),
        ("MRC_REDIS_URL", "redis://127.0.0.1:notaport/0"),
        ("MRC_REDIS_URL", "http://127.0.0.1:6379"),
    ],
)
def test_bad_settings_are_one_line_naming_the_variable(env: dict[str, str], name: str, value: str) -> None:
    for done in (_worker({**env, name: value}), services.run_cli({**env, name: value}, "queues")):
        assert done.returncode == 2, done.stderr
        line = _one_line(done.stderr)
        assert name in line
        assert "bad settings" in line


def test_a_misspelt_setting_is_warned_about(env: dict[str, str]) -> None:
    done = services.run_cli({**env, "MRC_BATCH_MAX_JOB": "4"}, "queues", "--json")
    assert done.returncode == 0
    warned = [line for line in done.stderr.splitlines() if line.startswith("MRC_UNKNOWN_SETTING")]
    assert len(warned) == 1
    assert "MRC_BATCH_MAX_JOB" in warned[0]


@pytest.mark.parametrize("command", ["status", "result"])
@pytest.mark.parametrize("job_id", ["../inputs/x", "a/b", "-", "x" * 129, "id\u00e9"])
def test_a_job_id_no_submit_could_make_is_exit_2_before_any_service(
    env: dict[str, str], command: str, job_id: str
) -> None:
    dead = {"MRC_REDIS_URL": _dead_url("redis") + "/0", "MRC_S3_ENDPOINT_URL": _dead_url("http")}
    done = services.run_cli({**env, **dead}, command, "--", job_id, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "job_id" in _one_line(done.stderr)
    assert done.stdout == ""
