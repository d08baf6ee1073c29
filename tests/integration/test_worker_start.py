"""A worker between its start and its first job: stopped while it loads its model, as a plain process and
as PID 1 of a container (review, helper-116: PID 1 without a handler ignores SIGTERM, so a rollout's
worker loaded on, took jobs and was killed with them in hand at the grace period's end), and a model
that loads but cannot run on its machine (a traceback and exit 1 before: a clear line and exit 70)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scripts import devservices as services

pytestmark = pytest.mark.integration


def _blocked_model(tmp_path: Path) -> Path:
    """A model folder whose config.json is a FIFO no one writes: loading it waits for good, so the
    signal always finds the worker loading, however fast or slow the machine."""
    folder = tmp_path / "model"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    return folder


def _pid_namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(
        ["unshare", "--fork", "--pid", "--mount-proc", "true"], capture_output=True, check=False
    )
    return done.returncode == 0


@pytest.mark.parametrize(
    ("as_pid_1", "after_s"),
    [(False, 0.0), (False, 0.5), (True, 0.5)],
    ids=["process-in-its-imports", "process", "pid-1"],
)
def test_a_worker_stopped_while_it_loads_its_model_stops_at_once(
    env: dict[str, str], tmp_path: Path, as_pid_1: bool, after_s: float
) -> None:
    """At once after it listens, the signal finds the worker importing torch: an exception raised
    there (the first fix) left numpy half-imported, which raised its own ImportError (a fresh clone's
    CI, on a busy machine). Later, it is waiting on the model's files."""
    if as_pid_1 and not _pid_namespaces():  # root here and in CI; a user without them has no containers
        pytest.skip("unshare cannot make a PID namespace here (not root)")
    hostname = f"loading-{tmp_path.name[-8:]}"
    worker_env = {**env, "MRC_MODEL": str(_blocked_model(tmp_path)), "MRC_METRICS_PORT": "0"}
    log = tmp_path / "worker.log"
    prefix = ["unshare", "--fork", "--pid", "--mount-proc"] if as_pid_1 else []
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*prefix, str(services.BIN / "mrc-worker"), "--hostname", hostname],
            env=worker_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        services.wait_for(lambda: "MRC_HTTP_LISTENING|" in log.read_text(), 120, "MRC_HTTP_LISTENING", proc)
        listed = json.loads(services.run_cli(env, "queues", "--json").stdout)["workers"]
        assert hostname in {w["hostname"] for w in listed}, "its heartbeat shows it loading"
        worker = proc.pid
        if as_pid_1:  # the worker is unshare's child, PID 1 of its namespace
            worker = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
            status = Path(f"/proc/{worker}/status").read_text().splitlines()
            assert next(line for line in status if line.startswith("NSpid:")).split()[-1] == "1"
        time.sleep(after_s)  # inside the load either way: it waits on the FIFO for good
        os.kill(worker, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the old code: still loading (PID 1) or killed (-15)
        proc.wait()
    text = log.read_text()
    stopped = [line for line in text.splitlines() if line.startswith("MRC_WORKER_STOPPED|")]
    assert len(stopped) == 1, text
    assert "|exit_code=0|while_starting=1" in stopped[0]
    assert "Traceback" not in text
    assert "MRC_CONSUMING" not in text
    listed = json.loads(services.run_cli(env, "queues", "--json").stdout)["workers"]
    assert hostname not in {w["hostname"] for w in listed}, "a stopped worker's entry stays"


def test_a_model_that_loads_but_cannot_run_is_exit_70_with_its_reason(env: dict[str, str]) -> None:
    """The warm-up runs the model once, so a model that cannot run on the machine (Triton's grammar
    kernel without a C compiler, a device fault) fails before the worker takes a job: one line
    naming why, exit 70 for its supervisor, no traceback."""
    worker_env = {**env, "MRC_MODEL": "echo", "MRC_ECHO_DEVICE_FAULT_ON": "warm up", "MRC_METRICS_PORT": "0"}
    done = subprocess.run(
        [str(services.BIN / "mrc-worker")], env=worker_env, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 70, done.stdout + done.stderr
    assert "mrc-worker: the model cannot run on this machine: RuntimeError: CUDA error" in done.stderr
    assert "MRC_FATAL" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "MRC_WORKER_READY" not in done.stdout + done.stderr
