"""`mrc backlog` when Redis loses what a pass relies on, against real Redis, S3 and (for the wait) a
real worker: a pass killed and resumed onto a full lane, records a worker made anew, a run's record
and lease lost mid-pass (a restart without persistence: FLUSHALL here), and a `--wait` whose jobs
were lost. Each came from a review (helper-76) that found jobs queued but out of sight, lines refused
for good, a run counted twice, and a wait that ended with jobs that would never run."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest
import redis as redis_lib
import structlog

from producer.client import Client
from scripts import devservices as services
from shared import names
from shared.stores import open_run_files
from tests.integration.test_backlog import _queued_ids, _start_run, _write
from tests.integration.test_backlog import own as own  # the fixture: Redis and S3 of the test's own

pytestmark = pytest.mark.integration


def _status(env: dict[str, str], run_id: str) -> dict[str, object]:
    shown = services.run_cli(env, "backlog", "status", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    return dict(json.loads(shown.stdout))


def test_a_resume_that_finds_the_lane_full_keeps_what_the_killed_pass_queued_in_sight(
    own: dict[str, str], tmp_path: Path
) -> None:
    """The killed pass left a partial index; the resume found the lane full at once (--no-block) and
    wrote the whole index without those jobs: status 0/0, cancel 0, with 20 queued."""
    env = {**own, "MRC_BACKLOG_MAX_DEPTH": "20"}
    proc = _start_run(env, tmp_path, "full", 60, 1000)
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    partial = names.run_key("", "full", "index/00000000.partial.jsonl")
    files = open_run_files(services.settings_from_env(own))
    services.wait_for(
        lambda: files.get_text(partial) is not None, 60, "the waiting pass's partial index", proc
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lane.llen(names.queue_name("backlog")) == 20
    resumed = services.run_cli(env, "backlog", "--resume", "full", "--no-block")
    assert resumed.returncode == 4, resumed.stderr
    status = _status(env, "full")
    assert (status["jobs"], status["queued"], status["lines"]) == (20, 20, 20)
    cancel = services.run_cli(env, "backlog", "cancel", "full")
    assert json.loads(cancel.stdout)["cancelled"] == 20, cancel.stderr


def test_a_record_a_worker_made_anew_is_taken_as_the_lines_own_job(
    own: dict[str, str], tmp_path: Path
) -> None:
    """A worker that finishes a job whose record Redis lost writes a record without the fingerprint;
    the next pass refused the line as "custom_id already used" for good (exit 1, out of the results)."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": f"Q{i}?"}
        for i in range(3)
    ]
    client = Client(services.settings_from_env(own))
    client.records.set_state(
        "anew.c1", "succeeded", result_uri=f"s3://{own['MRC_S3_BUCKET']}/results/anew.c1.json"
    )
    done = services.run_cli(own, "backlog", str(_write(tmp_path / "m.jsonl", rows)), "--run-id", "anew")
    assert done.returncode == 0, done.stderr
    assert sorted(_queued_ids(own)) == ["anew.c0", "anew.c2"]
    status = _status(own, "anew")
    assert (status["lines"], status["jobs"], status["invalid_lines"], status["succeeded"]) == (3, 3, 0, 1)


def test_a_pass_whose_run_record_redis_lost_counts_again_from_the_index(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Redis emptied mid-pass: the jobs queued before are queued again, once, and the run counts each
    line once; a second pass started then (the cron command again) and the first never both go on."""
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    proc = _start_run(own, tmp_path, "gone", 1000, 250, "--interval", "0")
    services.wait_for(lambda: lane.llen(names.queue_name("backlog")) > 100, 60, "jobs queued", proc)
    lane.flushall()
    assert proc.wait(120) == 0, (tmp_path / "gone.err").read_text()
    assert "record was lost with Redis's data" in (tmp_path / "gone.err").read_text()
    assert sorted(_queued_ids(own)) == sorted(f"gone.c{i}" for i in range(1000)), "lost, or twice"
    status = _status(own, "gone")
    assert (status["lines"], status["jobs"], status["queued"]) == (1000, 1000, 1000)

    lane.flushall()
    first = _start_run(own, tmp_path, "twice", 1000, 250, "--interval", "0")
    services.wait_for(lambda: lane.llen(names.queue_name("backlog")) > 100, 60, "jobs queued", first)
    lane.flushall()  # its lease and record gone: the same command again takes the run
    second = services.run_cli(own, "backlog", str(tmp_path / "twice.jsonl"), "--run-id", "twice")
    # The second ends first (no --rate); the first then finds the record another pass's and goes over
    # the run again, or finds that pass still holding the run and stops (exit 2).
    codes = sorted([first.wait(120), second.returncode])
    assert codes in ([0, 0], [0, 2]), (second.stderr, (tmp_path / "twice.err").read_text())
    assert sorted(_queued_ids(own)) == sorted(f"twice.c{i}" for i in range(1000))
    status = _status(own, "twice")
    assert (status["lines"], status["jobs"]) == (1000, 1000), "both passes counted the run"


def test_a_wait_whose_jobs_redis_lost_queues_them_again_and_a_ctrl_c_names_the_way_on(
    own: dict[str, str], tmp_path: Path
) -> None:
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": f"Q{i}?"}
        for i in range(30)
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    err_file = tmp_path / "waiting.err"
    waiting = services.start_cli(
        own, "backlog", str(path), "--run-id", "w", "--wait", "--interval", "0", stderr=err_file
    )
    services.wait_for(lambda: _status(own, "w")["state"] == "enqueued", 60, "the run enqueued", waiting)
    waiting.send_signal(signal.SIGINT)
    code = waiting.wait(60)
    err = err_file.read_text()
    assert code == 130, err
    assert "mrc backlog status w" in err
    assert "Traceback" not in err

    err_file = tmp_path / "wait.err"
    again = ("backlog", "--resume", "w", "--wait", "--interval", "0")
    resumed = services.start_cli(own, *again, stderr=err_file)
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    services.wait_for(lambda: "run w: " in err_file.read_text(), 60, "the wait", resumed)
    lane.flushall()  # the run's record, its jobs' and their messages: gone
    worker = services.start_worker({**own, "MRC_MODEL": "echo"}, tmp_path / "worker.log")
    try:
        assert resumed.wait(120) == 1, err_file.read_text()  # every job failed: the image is not there
    finally:
        worker.stop()
    assert "30 jobs of run w have no record" in err_file.read_text()
    report = json.loads(services.run_cli(own, "backlog", "report", "w").stdout)
    assert report["counts"] == {"failed": 30}


def test_a_cancelled_run_stays_cancelled_when_redis_loses_its_record(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-78: after a FLUSHALL a --wait's pass queued the cancelled run's 100 jobs again; a
    cancel of a run whose record alone was lost refused, with its jobs queued."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": f"Q{i}?"}
        for i in range(20)
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    assert services.run_cli(own, "backlog", str(path), "--run-id", "halt").returncode == 0
    data = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    data.delete(names.run_record_key("halt"))  # its record alone (a partial failover)
    cancel = services.run_cli(own, "backlog", "cancel", "halt")
    assert cancel.returncode == 0, cancel.stderr
    assert json.loads(cancel.stdout)["cancelled"] == 20
    data.flushall()
    assert _status(own, "halt")["state"] == "cancelled"
    again = services.run_cli(own, "backlog", str(path), "--run-id", "halt", "--wait", "--timeout", "30")
    assert again.returncode == 2, again.stderr
    assert "was cancelled" in again.stderr
    assert _queued_ids(own) == []


@pytest.mark.parametrize("step", ["enqueue", "wait"])
def test_sigterm_stops_a_backlog_run_as_ctrl_c_does_with_143(
    own: dict[str, str], tmp_path: Path, step: str
) -> None:
    """A CronJob's `mrc backlog` is PID 1 of its container, where a process without a handler ignores
    SIGTERM: a deleted Job, or one past its deadline, went on until the grace period's SIGKILL and
    said nothing (review, helper-116, on the worker; the same class here). It stops as Ctrl-C stops it,
    saying how to go on, with 143: the handler that gives 143 is what makes PID 1 stop at all."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": f"Q{i}?"}
        for i in range(30)
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    err_file = tmp_path / "run.err"
    run_id = f"term-{step}"
    env = {**own, "MRC_BACKLOG_MAX_DEPTH": "10"} if step == "enqueue" else own  # enqueue: waits for room
    running = services.start_cli(
        env, "backlog", str(path), "--run-id", run_id, "--wait", "--interval", "0", stderr=err_file
    )
    said = "waiting for room" if step == "enqueue" else f"run {run_id}: "
    services.wait_for(
        lambda: said in err_file.read_text() and _status(own, run_id)["state"] in ("enqueuing", "enqueued"),
        60, f"the run's {step}", running,
    )  # fmt: skip
    running.send_signal(signal.SIGTERM)
    code = running.wait(60)
    err = err_file.read_text()
    assert code == 143, err
    assert "Traceback" not in err
    how_to_go_on = f"mrc backlog status {run_id}" if step == "wait" else "Go on with: mrc backlog"
    assert how_to_go_on in err


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_submit_stopped_in_its_wait_names_the_job_it_queued(
    own: dict[str, str], tmp_path: Path, stop: signal.Signals, code: int
) -> None:
    """`mrc submit --wait` without --job-id, stopped while it waits: the job is queued and runs, but its
    id was drawn by the command and printed nowhere, so its result could not be asked for."""
    from tests.support import imagegen

    image = tmp_path / "p.jpg"
    image.write_bytes(imagegen.photo(64, 48, seed=5))
    err_file, out_file = tmp_path / "submit.err", tmp_path / "submit.out"
    waiting = services.start_cli(
        own, "submit", "--image", str(image), "--prompt", "Refund?", "--wait", "--timeout", "300",
        stdout=out_file, stderr=err_file,
    )  # fmt: skip
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])

    def published() -> bool:  # sent and confirmed: what is left is the wait (a signal before is Ctrl-C's)
        keys = lane.keys(names.job_key("*"))
        return bool(keys) and lane.hget(keys[0], "published") == b"1"

    services.wait_for(published, 60, "the job's message sent", waiting)
    (key,) = lane.keys(names.job_key("*"))
    job_id = key.decode().removeprefix(names.job_key(""))
    waiting.send_signal(stop)
    assert waiting.wait(60) == code
    err = err_file.read_text()
    assert f"job {job_id} is queued" in err, err
    assert f"mrc result {job_id}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_submit_stopped_after_its_push_landed_keeps_the_job_and_names_it(
    own: dict[str, str], tmp_path: Path, stop: signal.Signals, code: int
) -> None:
    """Review, helper-119: with MRC_REDIS_WAIT_REPLICAS the push and its WAIT for replicas go in one
    round trip; a stop during the WAIT (here: a replica that never comes, 5 s) freed the claim of a job
    that was queued, deleting its record, and said only `interrupted`: the job ran under an id printed
    nowhere, and a user who submitted again ran it twice. The push landed, so the claim becomes the
    job's record and the line names the job."""
    from tests.support import imagegen

    env = {**own, "MRC_REDIS_WAIT_REPLICAS": "1", "MRC_REDIS_WAIT_TIMEOUT_MS": "5000"}
    image = tmp_path / "p.jpg"
    image.write_bytes(imagegen.photo(64, 48, seed=6))
    err_file = tmp_path / "submit.err"
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    submitting = services.start_cli(
        env, "submit", "--image", str(image), "--prompt", "Refund?", "--wait", "--timeout", "300",
        stderr=err_file,
    )  # fmt: skip
    services.wait_for(lambda: lane.keys(names.push_key("*")), 60, "the push", submitting)
    submitting.send_signal(stop)
    assert submitting.wait(60) == code
    err = err_file.read_text()
    assert "replicas confirmed" not in err, "the stop came after the WAIT: not the window this tests"
    (key,) = lane.keys(names.job_key("*"))
    job_id = key.decode().removeprefix(names.job_key(""))
    assert lane.hget(key, "published") == b"1", "the queued job keeps its record"
    assert lane.llen(names.queue_name("interactive")) == 1
    assert f"job {job_id} is queued" in err, err
    assert "Traceback" not in err


def test_a_stop_in_the_wait_after_an_unconfirmed_push_says_the_job_may_be_queued(
    own: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review, helper-119: a push whose reply was lost where Redis could not be asked either is maybe
    queued (exit 6 without --wait); with --wait, a Ctrl-C in the wait then said the job `is queued`."""
    from producer import cli
    from producer.client import Client
    from producer.queue.sender import Queue
    from tests.support import imagegen

    for name, value in own.items():
        monkeypatch.setenv(name, value)
    image = tmp_path / "p.jpg"
    image.write_bytes(imagegen.photo(64, 48, seed=7))

    def lost(self: Queue, job: object, push_id: str | None = None, ahead: bool = False) -> None:
        raise ConnectionError("its reply lost with the connection")

    def stopped(self: Client, job_id: str, timeout: float) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(Queue, "_send", lost)
    monkeypatch.setattr(Queue, "_landed", lambda self, job: None)
    monkeypatch.setattr(Client, "wait", stopped)
    # cli.main points the logs at this test's captured stderr, closed after it: later tests in this
    # process that log would write to a closed file (a test of the worker's exit codes did)
    saved, handlers = structlog.get_config(), logging.getLogger().handlers[:]
    try:
        code = cli.main(["submit", "--image", str(image), "--prompt", "Refund?", "--wait", "--timeout", "30"])
    finally:
        structlog.configure(**saved)
        logging.getLogger().handlers[:] = handlers
    err = capsys.readouterr().err
    assert code == 130
    assert "is queued" not in err, err
    assert "may be queued" in err
    assert "--job-id" in err


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_mrc_script_itself_stopped_in_a_submits_wait_names_the_job(
    own: dict[str, str], tmp_path: Path, stop: signal.Signals, code: int
) -> None:
    """Review, helper-123: the `mrc` script (not the tests' fork server, whose children imported the
    package before they were `mrc`) exits at once on Ctrl-C from its first moment, and its main took
    back only SIGTERM: Ctrl-C ended every command without a word, the queued job unnamed."""
    import subprocess

    from tests.support import imagegen

    image = tmp_path / "p.jpg"
    image.write_bytes(imagegen.photo(64, 48, seed=8))
    err_file = tmp_path / "submit.err"
    with err_file.open("wb") as err:
        submitting = subprocess.Popen(
            [str(services.BIN / "mrc"), "submit", "--image", str(image), "--prompt", "Refund?", "--wait",
             "--timeout", "300"],
            env=own, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])

        def published() -> bool:
            keys = lane.keys(names.job_key("*"))
            return bool(keys) and lane.hget(keys[0], "published") == b"1"

        services.wait_for(published, 120, "the job's message sent", submitting)
        submitting.send_signal(stop)
        assert submitting.wait(60) == code
    finally:
        if submitting.poll() is None:
            submitting.kill()
            submitting.wait(10)
    (key,) = lane.keys(names.job_key("*"))
    job_id = key.decode().removeprefix(names.job_key(""))
    err_text = err_file.read_text()
    assert f"job {job_id} is queued" in err_text, err_text
