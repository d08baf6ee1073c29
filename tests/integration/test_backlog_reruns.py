"""`mrc backlog` run again, resumed or cut short, against real Redis and S3 (no worker: what is
queued stays queued): lines no index holds are queued once, jobs Redis lost are queued again while
their records would still live, and the run's counts follow its index. Apart from test_backlog.py so
the test processes (a file each) share the backlog tests between them."""

from __future__ import annotations

import json
import signal
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis as redis_lib

from producer.backlog import manifest
from producer.backlog.run import Backlog
from producer.client import Client
from scripts import devservices as services
from shared import names
from shared.errors import StoreUnavailable
from shared.jobs import rfc3339
from shared.stores import open_run_files
from tests.integration.test_backlog import _file, _queued_ids, _write
from tests.integration.test_backlog import own as own  # the fixture: Redis and S3 of the test's own
from tests.support import imagegen

pytestmark = pytest.mark.integration


def test_ctrl_c_stops_the_enqueue_in_one_line_naming_the_resume(own: dict[str, str], tmp_path: Path) -> None:
    """Review, helper-63: a bare KeyboardInterrupt traceback, no word of how to go on."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": "Q?"}
        for i in range(2000)
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    err_file = tmp_path / "stop.err"
    proc = services.start_cli(own, "backlog", str(path), "--run-id", "stop", "--rate", "200", stderr=err_file)
    services.wait_for(lambda: len(_queued_ids(own)) > 0, 120, "the first jobs queued", proc)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(60)
    err = err_file.read_text()
    assert code == 130, err
    assert "Traceback" not in err
    assert "mrc backlog --resume stop" in err
    resumed = services.run_cli(own, "backlog", "--resume", "stop", "--interval", "0")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(_queued_ids(own)) == sorted(f"stop.c{i}" for i in range(2000))


def test_a_job_that_failed_without_a_stored_result_is_failed_in_the_report_and_mrc_result(
    own: dict[str, str], tmp_path: Path
) -> None:
    """A job S3 refused the result of is dead-lettered failed, its record saying why (review,
    helper-63: the report and `mrc result` called it pending for good, while status said failed)."""
    rows = [
        {"custom_id": c, "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": f"Q {c}?"} for c in "ab"
    ]
    done = services.run_cli(own, "backlog", str(_write(tmp_path / "m.jsonl", rows)), "--run-id", "lost")
    assert done.returncode == 0, done.stderr
    client = Client(services.settings_from_env(own))
    why = {"error_code": "internal_error", "error_message": "the result could not be stored"}
    client.records.set_state("lost.a", "failed", **why)
    shown = services.run_cli(own, "result", "lost.a")
    assert shown.returncode == 1, shown.stderr
    result = json.loads(shown.stdout)
    assert (result["status"], result["error"]["code"], result["result_stored"]) == (
        "failed",
        "internal_error",
        False,
    )
    assert result["error"]["retryable"] is False  # as the worker's MRC_ERROR line says
    pending = services.run_cli(own, "result", "lost.b")
    assert (pending.returncode, pending.stderr) == (3, "mrc: no result for lost.b yet (it is queued)\n")
    unknown = services.run_cli(own, "result", "lost.never")  # review, helper-124: it said "yet"
    assert unknown.returncode == 3
    assert "no job lost.never is known: no record and no result" in unknown.stderr
    client.records.set_state("lost.ended", "failed")  # ended, its failure's code and result gone
    ended = services.run_cli(own, "result", "lost.ended")
    assert ended.returncode == 3
    assert ended.stderr == "mrc: job lost.ended ended failed without a stored result\n"
    report = services.run_cli(own, "backlog", "report", "lost")
    assert report.returncode == 1, report.stderr  # a run with a failed job (b is still pending)
    assert json.loads(report.stdout)["counts"] == {"failed": 1, "pending": 1}
    assert [row["custom_id"] for row in _file(own, "lost", "errors.jsonl")] == ["a"]


def test_a_run_again_after_redis_lost_its_data_queues_what_was_lost(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-63: with Redis restarted empty, the run's index in S3 said every chunk was done,
    so running it again queued nothing (exit 0) and its jobs never ran; status called it done."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": f"Q{i}?"}
        for i in range(3)
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    assert services.run_cli(own, "backlog", str(path), "--run-id", "gone").returncode == 0
    client = Client(services.settings_from_env(own))
    client.results.put_result("gone.c0", {"job_id": "gone.c0", "status": "succeeded", "text": "yes"})
    data = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    data.delete(*[names.job_key(f"gone.c{i}") for i in range(3)], *names.queue_keys("backlog"))
    status = json.loads(services.run_cli(own, "backlog", "status", "gone", "--json").stdout)
    assert (status["unknown"], status["state"]) == (3, "enqueued")  # records lost, not expired: not done
    assert status["lost"] == 2  # c0's result is stored (review, helper-78: counted lost, a pass ran)
    data.flushall()  # a restart without persistence
    again = services.run_cli(own, "backlog", str(path), "--run-id", "gone", "--interval", "0")
    assert again.returncode == 0, again.stderr
    assert sorted(_queued_ids(own)) == ["gone.c1", "gone.c2"]  # c0 is done: its result is stored
    status = json.loads(services.run_cli(own, "backlog", "status", "gone", "--json").stdout)
    assert (status["lines"], status["jobs"], status["queued"]) == (3, 3, 2)
    assert status["state"] != "done"
    again = services.run_cli(own, "backlog", str(path), "--run-id", "gone", "--interval", "0")
    assert sorted(_queued_ids(own)) == ["gone.c1", "gone.c2"]  # nothing twice


def test_a_rerun_queues_lost_jobs_once_counts_them_once_and_never_reruns_expired_ones(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-65: jobs lost (records gone, run record kept) and queued again by a --no-block
    pass cut short were counted again by the resume (lines 50 for 30); a blank line where the index
    holds a job (an OpenAI batch's resume passes indexed lines so) dropped its entry; and a run past
    its jobs' 7 days queued again a job that had failed without a stored result."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": f"Q{i}?"}
        for i in range(30)
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    assert services.run_cli(own, "backlog", str(path), "--run-id", "cut").returncode == 0
    data = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    data.delete(*[names.job_key(f"cut.c{i}") for i in range(30)], *names.queue_keys("backlog"))
    cut = services.run_cli({**own, "MRC_BACKLOG_MAX_DEPTH": "10"}, "backlog", str(path), "--run-id", "cut",
                           "--no-block")  # fmt: skip
    assert cut.returncode == 4, cut.stderr
    assert len(_queued_ids(own)) == 10
    assert services.run_cli(own, "backlog", "--resume", "cut", "--interval", "0").returncode == 0
    assert sorted(_queued_ids(own)) == sorted(f"cut.c{i}" for i in range(30))
    status = json.loads(services.run_cli(own, "backlog", "status", "cut", "--json").stdout)
    assert (status["lines"], status["jobs"], status["queued"]) == (30, 30, 30)
    # a pass that gives an indexed line blank cannot queue it again: its entry stays
    data.delete(names.job_key("cut.c3"), *names.queue_keys("backlog"))
    backlog = Backlog(Client(services.settings_from_env(own)))
    with path.open("rb") as handle:
        blanked = [(n, b"" if n == 4 else raw) for n, raw in manifest.read_lines(handle)]
    backlog.enqueue(iter(blanked), "cut", str(path))
    assert len(_file(own, "cut", "index/00000000.jsonl")) == 30
    assert _queued_ids(own) == []
    # past its jobs' 7 days (the mark its first pass left beside the index), a job without a record
    # is one whose record expired: not queued again
    files = open_run_files(services.settings_from_env(own))
    files.put_text(names.run_key("", "cut", "started_at"), "2026-01-01T00:00:00Z")
    data.delete(*[names.job_key(f"cut.c{i}") for i in range(30)])
    again = services.run_cli(own, "backlog", str(path), "--run-id", "cut", "--interval", "0")
    assert again.returncode == 0, again.stderr
    assert _queued_ids(own) == []


def test_a_lost_job_is_known_by_the_runs_first_pass_and_counted_as_what_it_is_now(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-66: with the run's record gone too (expired after 30 days, or lost), the record
    made anew read as a run begun now, so jobs whose records had expired were queued again; and a
    lost job whose line is invalid now stayed counted valid (the ops page saw the run never end)."""
    photos = [tmp_path / f"p{i}.jpg" for i in range(3)]
    for i, photo in enumerate(photos):
        photo.write_bytes(imagegen.photo(32, 32, seed=i))
    rows = [{"custom_id": f"c{i}", "image": str(photo), "prompt": "Q?"} for i, photo in enumerate(photos)]
    path = _write(tmp_path / "m.jsonl", rows)
    assert services.run_cli(own, "backlog", str(path), "--run-id", "aged").returncode == 0
    data = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    jobs_and_lane = [*(names.job_key(f"aged.c{i}") for i in range(3)), *names.queue_keys("backlog")]
    # lost while young, one line's image gone since: two queued again, one invalid, counted so
    data.delete(*jobs_and_lane)
    photos[1].unlink()
    again = services.run_cli(own, "backlog", str(path), "--run-id", "aged", "--interval", "0")
    assert again.returncode == 1, again.stderr  # an invalid line
    assert sorted(_queued_ids(own)) == ["aged.c0", "aged.c2"]
    record = data.hgetall(names.run_record_key("aged"))
    assert (record[b"lines"], record[b"valid"], record[b"invalid"]) == (b"3", b"2", b"1")
    # begun 20 days ago, its record gone as well: what has no record expired, and is not queued again
    files = open_run_files(services.settings_from_env(own))
    mark = names.run_key("", "aged", "started_at")
    files.put_text(mark, "2026-11-16T00:00:00Z")
    data.delete(*jobs_and_lane, names.run_record_key("aged"))
    photos[1].write_bytes(imagegen.photo(32, 32, seed=1))
    for _ in range(2):  # nor on the pass after, whose run record is the one made anew (helper-67)
        assert services.run_cli(own, "backlog", str(path), "--run-id", "aged").returncode == 1
        assert _queued_ids(own) == []
    # a mark that is no date: taken as old, not a traceback
    files.put_text(mark, "yesterday")
    done = services.run_cli(own, "backlog", str(path), "--run-id", "aged")
    assert "Traceback" not in done.stderr
    assert _queued_ids(own) == []
    # a run from before the mark: its first pass since writes it from the run's record, so a later
    # loss of Redis's data is still recovered (helper-67)
    files.put_text(mark, "")
    # a day ago, from today: a fixed date became older than the records' week and the run was taken
    # for one whose lost jobs had expired (this test failed from 2026-12-07 23:00 on)
    began = rfc3339(datetime.now(UTC) - timedelta(days=1), timespec="seconds")
    data.hset(names.run_record_key("aged"), "created_at", began)
    services.run_cli(own, "backlog", str(path), "--run-id", "aged")
    assert files.get_text(mark) == began
    data.flushall()
    services.run_cli(own, "backlog", str(path), "--run-id", "aged")
    assert sorted(_queued_ids(own)) == ["aged.c0", "aged.c2"]  # c1's line is indexed invalid


def test_a_resume_reads_relative_image_paths_from_where_the_run_began(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-63: resumed from another directory, the lines of relative paths were indexed
    'image file not found' for good."""
    lab = tmp_path / "lab"
    (lab / "img").mkdir(parents=True)
    (lab / "img" / "p.jpg").write_bytes(imagegen.photo(64, 48, seed=4))
    rows = [{"custom_id": f"c{i}", "image": "img/p.jpg", "prompt": f"Q{i}?"} for i in range(60)]
    _write(lab / "m.jsonl", rows)
    mrc = str(services.BIN / "mrc")
    first = subprocess.run(
        [mrc, "backlog", "m.jsonl", "--run-id", "rel", "--no-block"], cwd=lab,
        env={**own, "MRC_BACKLOG_MAX_DEPTH": "20"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert first.returncode == 4, first.stderr
    resumed = subprocess.run(
        [mrc, "backlog", "--resume", "rel", "--interval", "0"], cwd=tmp_path, env=own,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert len(_queued_ids(own)) == 60
    # a directory that cannot be entered any more (another host, removed): the resume goes on from
    # here, saying so (review, helper-65: it refused, and every 'go on with' message names it)
    gone = tmp_path / "gone"
    gone.mkdir()
    _write(tmp_path / "s3.jsonl", [{**row, "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg"} for row in rows])
    first = subprocess.run(
        [mrc, "backlog", str(tmp_path / "s3.jsonl"), "--run-id", "far", "--no-block"], cwd=gone,
        env={**own, "MRC_BACKLOG_MAX_DEPTH": "70"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert first.returncode == 4, first.stderr
    gone.rmdir()
    resumed = subprocess.run(
        [mrc, "backlog", "--resume", "far", "--interval", "0"], cwd=tmp_path, env=own,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "cannot be entered here" in resumed.stderr
    assert len(_queued_ids(own)) == 120


def test_a_line_repeated_is_one_job_in_the_runs_status(own: dict[str, str], tmp_path: Path) -> None:
    """Review, helper-63: the same line twice was two jobs in status, its tokens summed twice."""
    line = {"custom_id": "d", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": "Q?"}
    rows = [line, {**line, "custom_id": "e"}, line]
    done = services.run_cli(own, "backlog", str(_write(tmp_path / "m.jsonl", rows)), "--run-id", "twice")
    assert done.returncode == 0, done.stderr
    status = json.loads(services.run_cli(own, "backlog", "status", "twice", "--json").stdout)
    assert (status["lines"], status["jobs"], status["queued"]) == (3, 2, 2)
    assert len(_file(own, "twice", "index/00000000.jsonl")) == 3  # each line is in the index
    # Its record expires after 30 days; its index and results stay in S3, and status and report read
    # them (review, helper-74: "no backlog run").
    redis_lib.Redis.from_url(own["MRC_REDIS_URL"]).delete(names.run_record_key("twice"))
    status = json.loads(services.run_cli(own, "backlog", "status", "twice", "--json").stdout)
    assert status["state"] == "lost"  # within its 30 days: Redis lost it (review, helper-76: "expired")
    files = open_run_files(services.settings_from_env(own))
    files.put_text(names.run_key("", "twice", "started_at"), "2026-01-01T00:00:00Z")  # its first pass
    status = json.loads(services.run_cli(own, "backlog", "status", "twice", "--json").stdout)
    assert (status["state"], status["jobs"], status["queued"]) == ("expired", 2, 2)
    report = services.run_cli(own, "backlog", "report", "twice")
    assert report.returncode == 3, report.stderr  # pending: no worker here
    assert [row["custom_id"] for row in _file(own, "twice", "results.jsonl")] == ["d", "e", "d"]
    cancel = services.run_cli(own, "backlog", "cancel", "twice")
    assert cancel.returncode == 2
    assert "has expired" in cancel.stderr
    nowhere = services.run_cli(own, "backlog", "report", "never-was")
    assert nowhere.returncode == 2
    assert "no backlog run 'never-was'" in nowhere.stderr


def test_lines_a_manifest_gained_since_its_run_are_queued_by_running_it_again(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-63: a manifest of 3,000 lines grown to 5,000 (the last chunk then partial) was
    'enqueued 0, already there 3000', exit 0, and lines 3,001-5,000 were nowhere."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": "Q?"}
        for i in range(7000)
    ]
    path = tmp_path / "grow.jsonl"
    first = services.run_cli(
        own, "backlog", str(_write(path, rows[:3000])), "--run-id", "grow", "--interval", "0"
    )
    assert first.returncode == 0, first.stderr
    again = services.run_cli(own, "backlog", str(_write(path, rows)), "--run-id", "grow", "--interval", "0")
    assert again.returncode == 0, again.stderr
    assert "enqueued 4000" in again.stdout + again.stderr
    assert sorted(_queued_ids(own)) == sorted(f"grow.c{i}" for i in range(7000))
    status = json.loads(services.run_cli(own, "backlog", "status", "grow", "--json").stdout)
    assert (status["lines"], status["jobs"], status["queued"]) == (7000, 7000, 7000)


def test_a_cancel_of_a_done_run_changes_nothing_and_a_run_again_still_makes_it_whole(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-92: `mrc backlog cancel` on a finished run said {"cancelled": 0} yet marked the run
    cancelled for good, and running its manifest again after Redis lost its data (the documented
    recovery) was refused: "run was cancelled; start a new run id"."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": f"Q{i}?"}
        for i in range(2)
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    assert services.run_cli(own, "backlog", str(path), "--run-id", "over").returncode == 0
    records = Client(services.settings_from_env(own)).records
    for i in range(2):  # as a worker leaves them (no worker here)
        records.set_state(f"over.c{i}", "succeeded")
    data = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    data.delete(*names.queue_keys("backlog"))
    status = json.loads(services.run_cli(own, "backlog", "status", "over", "--json").stdout)
    assert status["state"] == "done"
    cancel = services.run_cli(own, "backlog", "cancel", "over")
    assert cancel.returncode == 0, cancel.stderr
    assert json.loads(cancel.stdout) == {"run_id": "over", "cancelled": 0}
    assert "is done: nothing to cancel" in cancel.stderr
    status = json.loads(services.run_cli(own, "backlog", "status", "over", "--json").stdout)
    assert status["state"] == "done"
    data.flushall()  # Redis restarted without its data: the run again queues what has no result
    again = services.run_cli(own, "backlog", str(path), "--run-id", "over", "--interval", "0")
    assert again.returncode == 0, again.stderr
    assert sorted(_queued_ids(own)) == ["over.c0", "over.c1"]


def test_a_failed_runs_status_says_so_and_a_cancel_leaves_it_failed(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-102: a batch that failed (its input gone) marks its run `failed`; `status` printed
    its counts with no word of it, and `cancel` turned it `cancelled` where the batch said failed."""
    rows = [{"custom_id": "c", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": "Q?"}]
    path = _write(tmp_path / "m.jsonl", rows)
    assert services.run_cli(own, "backlog", str(path), "--run-id", "broke").returncode == 0
    Client(services.settings_from_env(own)).records.set_state("broke.c", "succeeded")
    from shared.runs import RunRecords

    RunRecords(redis_lib.Redis.from_url(own["MRC_REDIS_URL"], decode_responses=True)).update(
        "broke", state="failed"
    )
    assert "(failed)" in services.run_cli(own, "backlog", "status", "broke").stdout
    cancel = services.run_cli(own, "backlog", "cancel", "broke")
    assert cancel.returncode == 0, cancel.stderr
    assert json.loads(cancel.stdout) == {"run_id": "broke", "cancelled": 0}
    assert "is failed: nothing to cancel" in cancel.stderr
    assert (
        json.loads(services.run_cli(own, "backlog", "status", "broke", "--json").stdout)["state"] == "failed"
    )


def test_a_cancel_while_s3_is_away_still_stops_the_run(own: dict[str, str], tmp_path: Path) -> None:
    """Review, helper-94: the look at whether the run was done read S3 first, and with S3 away the
    cancel raised before marking anything: an OpenAI batch's cancel (which calls it) left every job to
    run and be billed. The run is marked cancelled first, as before, and the S3 fault is said after."""
    rows = [{"custom_id": "c", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": "Q?"}]
    assert (
        services.run_cli(
            own, "backlog", str(_write(tmp_path / "m.jsonl", rows)), "--run-id", "away"
        ).returncode
        == 0
    )
    away = {
        **own,
        "MRC_S3_ENDPOINT_URL": f"http://127.0.0.1:{services.free_port()}",
        "MRC_CONNECT_TIMEOUT_S": "1",
    }
    backlog = Backlog(Client(services.settings_from_env(away)))
    with pytest.raises(StoreUnavailable):
        backlog.cancel("away")
    record = redis_lib.Redis.from_url(own["MRC_REDIS_URL"], decode_responses=True).hgetall(
        names.run_record_key("away")
    )
    assert record["state"] == "cancelled"


def test_a_run_of_invalid_lines_only_is_done_in_status_and_report(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-80: status said `enqueued` for good for a run whose every line was invalid (no
    job to wait for), where report said `done`."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{not json\n{"custom_id": "x", "image": "ftp://nowhere/x.jpg", "prompt": "a"}\n')
    ran = services.run_cli(own, "backlog", str(path), "--run-id", "allbad")
    assert ran.returncode == 1, ran.stderr  # invalid lines
    status = json.loads(services.run_cli(own, "backlog", "status", "allbad", "--json").stdout)
    assert (status["jobs"], status["state"]) == (0, "done")
    report = services.run_cli(own, "backlog", "report", "allbad")
    assert report.returncode == 1, report.stderr
    assert json.loads(report.stdout)["state"] == "done"
