"""`mrc backlog` against real Redis, S3 and workers: manifests in, results files out, resumable."""

from __future__ import annotations

import base64
import json
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
import redis as redis_lib

from producer.backlog import chunk_index, manifest, outages
from producer.backlog.run import Backlog
from producer.client import Client
from scripts import devservices as services
from shared import jobs, names
from shared.errors import StoreUnavailable
from shared.stores import open_run_files
from tests.conftest import MODEL_HOME, TEST_CPU_THREADS
from tests.support import imagegen
from tests.support.proxy import Proxy

pytestmark = pytest.mark.integration


@pytest.fixture
def own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_service: services.Service
) -> Iterator[dict[str, str]]:
    """A Redis and an S3 bucket of this test's own, with no worker: what is queued stays queued. The
    bucket is on the session's S3 server (a moto server of its own cost each test ~1.6 CPU-s)."""
    redis = services.start_redis(tmp_path / "redis")
    bucket = f"mrc-backlog-{uuid.uuid4().hex[:8]}"
    env = services.base_env(redis.url, s3_service.url, bucket, MODEL_HOME, TEST_CPU_THREADS)
    env["MRC_BACKLOG_MAX_DEPTH"] = "100000"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    yield env
    redis.stop()


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _queued_ids(env: dict[str, str]) -> list[str]:
    client = redis_lib.Redis.from_url(env["MRC_REDIS_URL"])
    raw = [m for key in names.queue_keys("backlog") for m in client.lrange(key, 0, -1)]
    return [json.loads(m)["headers"]["id"] for m in raw]


def _file(env: dict[str, str], run_id: str, name: str) -> list[dict[str, Any]]:
    files = open_run_files(services.settings_from_env(env))
    text = files.get_text(names.run_key("", run_id, name)) or ""
    return [json.loads(line) for line in text.splitlines()]


def _photo(client: Client, folder: Path, seed: int) -> tuple[Path, str]:
    """A local photo, and the same photo uploaded: (path, its s3:// URI)."""
    photo = folder / f"photo-{seed}.jpg"
    photo.write_bytes(imagegen.photo(320, 240, seed=seed))
    return photo, client.upload_image(photo)[0]


def test_a_manifest_runs_and_its_results_follow_the_manifest(
    env: dict[str, str], worker: services.Worker, client: Client, tmp_path: Path
) -> None:
    photo, in_s3 = _photo(client, tmp_path, seed=3)
    rows: list[Any] = [
        {"custom_id": "t-1", "image": str(photo), "prompt": "Is the box damaged?"},
        "{not json",
        {"custom_id": "t-2", "image": in_s3, "prompt": "Refund?", "max_new_tokens": 4, "ticket_id": "T2"},
        {"custom_id": "t-3", "image": "https://example.com/x.jpg", "prompt": "Refund?"},
        {"custom_id": "ticket #4 (photo)", "image": str(photo), "prompt": "What is torn?"},
        {"custom_id": "t-5", "image": in_s3},
        {"custom_id": "t-6", "image": str(tmp_path / "missing.jpg"), "prompt": "Refund?"},
        {"custom_id": "t-7", "image": in_s3, "prompt": "Where is the label?"},
    ]
    manifest_file = _write(tmp_path / "m.jsonl", rows)
    done = services.run_cli(env, "backlog", str(manifest_file), "--run-id", "e2e", "--wait",
                            "--interval", "0.5", "--timeout", "300", timeout=400)  # fmt: skip
    assert done.returncode == 1, done.stderr  # invalid lines make the run's exit 1
    assert done.stdout.splitlines()[0] == "e2e"
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["counts"] == {"succeeded": 4, "invalid": 4}
    assert summary["state"] == "done"  # as status says it (review, helper-79: "enqueued")
    assert "done" in done.stderr  # progress lines, plain off a terminal

    results = _file(env, "e2e", "results.jsonl")
    assert [r["custom_id"] for r in results] == ["t-1", "t-2", "ticket #4 (photo)", "t-7"]
    for row in results:
        stored = client.result(row["job_id"])
        assert stored is not None
        assert (row["status"], row["text"]) == (stored["status"], stored["text"])
        assert row["result_uri"] == client.results.result_uri(row["job_id"])
    assert client.result(results[1]["job_id"])["ticket_id"] == "T2"
    assert client.result(results[1]["job_id"])["lane"] == "backlog"
    errors = _file(env, "e2e", "errors.jsonl")
    assert [e["line"] for e in errors] == [2, 4, 6, 7]
    assert "not JSON" in errors[0]["invalid"]
    assert "image_source_forbidden" in errors[1]["invalid"]
    assert "missing field: prompt" in errors[2]["invalid"]
    assert "not found" in errors[3]["invalid"]

    again = services.run_cli(env, "backlog", str(manifest_file), "--run-id", "e2e", "--interval", "0")
    assert again.returncode == 1
    assert "enqueued 0" in again.stderr
    assert "invalid 4" in again.stderr


def _start_run(
    env: dict[str, str], folder: Path, run_id: str, lines: int, rate: int, *options: str
) -> services.Process:
    """`mrc backlog` of `lines` lines at `rate` a second, in the background (its stderr in the folder's
    `<run_id>.err`)."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{env['MRC_S3_BUCKET']}/in/{i}.jpg", "prompt": f"Q{i}?"}
        for i in range(lines)
    ]
    manifest_file = _write(folder / f"{run_id}.jsonl", rows)
    args = ("backlog", str(manifest_file), "--run-id", run_id, "--rate", str(rate), *options)
    return services.start_cli(env, *args, stderr=folder / f"{run_id}.err")


def test_resume_after_the_producer_is_killed_enqueues_exactly_what_is_missing(
    own: dict[str, str], tmp_path: Path
) -> None:
    total = 12_000
    proc = _start_run(own, tmp_path, "big", total, 3000)
    files = open_run_files(services.settings_from_env(own))
    depth = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    # Into the second chunk: some of its jobs queued (seen, not slept for), its index not yet written.
    services.wait_for(
        lambda: depth.llen(names.queue_name("backlog")) > 5500, 120, "jobs of the second chunk", proc
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = _queued_ids(own)
    assert 5000 < len(before) < total, "the kill came too early or too late to test anything"
    whole, _partial = chunk_index.listed(files.list_keys("runs/big/index/"))  # a slow chunk has a partial one
    assert whole == {0}, "the second chunk's index was already written"

    resumed = services.run_cli(own, "backlog", "--resume", "big", "--interval", "0")
    assert resumed.returncode == 0, resumed.stderr
    queued = _queued_ids(own)
    assert len(queued) == total, "a job queued twice, or one missing"
    assert set(queued) == {f"big.c{i}" for i in range(total)}
    status = json.loads(services.run_cli(own, "backlog", "status", "big", "--json").stdout)
    assert (status["jobs"], status["queued"], status["invalid_lines"]) == (total, total, 0)


def test_a_slow_chunk_is_seen_as_it_is_queued_and_a_kill_mid_way_is_resumed_whole(
    own: dict[str, str], tmp_path: Path
) -> None:
    """A `--rate` run's first chunk takes seconds: its jobs are in `status` while it is queued (a
    partial index), its progress is a line every `--interval` off a terminal (review, helper-74: none
    until the chunk's end), and a producer killed then is resumed to every line once, each counted once."""
    total = 4800  # 12 s at 400 a second, in one chunk: the kill comes before its end on a busy machine
    proc = _start_run(own, tmp_path, "slow", total, 400, "--interval", "0.5")
    files = open_run_files(services.settings_from_env(own))
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    partial = "runs/slow/index/00000000.partial.jsonl"
    services.wait_for(lambda: files.get_text(partial), 60, "the first chunk's partial index", proc)
    status = json.loads(services.run_cli(own, "backlog", "status", "slow", "--json").stdout)
    assert 0 < status["jobs"] == status["queued"] < total, status
    second = services.run_cli(own, "backlog", "--resume", "slow")  # one pass of a run at a time
    assert second.returncode == 2, second.stderr
    assert f"being enqueued by another pass (pid {proc.pid} on " in second.stderr
    seen = len((files.get_text(partial) or "").splitlines())
    services.wait_for(lambda: lane.llen(names.queue_name("backlog")) > seen, 60, "more jobs queued", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(files.list_keys("runs/slow/index/")) == [partial], "the kill came after the chunk's end"
    shown = [line for line in (tmp_path / "slow.err").read_text().splitlines() if line.startswith("enqueue:")]
    assert shown[0].startswith("enqueue: lines 0, enqueued 0"), shown  # the first line at once
    assert len({line.split(", ")[1] for line in shown}) >= 3, shown  # then as jobs go in
    # ...and its lines with them (review: "lines 0 ... 0.0 lines/s" until the chunk's end)
    counts = [[int(part.split()[-1]) for part in line.split(", ")[:2]] for line in shown]
    assert all(lines == enqueued for lines, enqueued in counts), shown
    assert "0.0 lines/s" not in shown[-1], shown

    resumed = services.run_cli(own, "backlog", "--resume", "slow", "--interval", "0")
    assert resumed.returncode == 0, resumed.stderr
    queued = _queued_ids(own)
    assert sorted(queued) == sorted(f"slow.c{i}" for i in range(total)), "a job queued twice, or missing"
    assert list(files.list_keys("runs/slow/index/")) == ["runs/slow/index/00000000.jsonl"]
    status = json.loads(services.run_cli(own, "backlog", "status", "slow", "--json").stdout)
    assert (status["lines"], status["jobs"], status["queued"]) == (total, total, total)


def test_strict_refuses_a_manifest_with_a_bad_line(own: dict[str, str], tmp_path: Path) -> None:
    rows = [{"custom_id": "a", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": "Q?"}, "oops"]
    out = services.run_cli(own, "backlog", str(_write(tmp_path / "m.jsonl", rows)), "--strict")
    assert out.returncode == 2
    assert "line 2" in out.stderr
    assert _queued_ids(own) == []
    # a custom_id given to two different jobs is a bad line too (review, helper-63: both ran, exit 1);
    # the same line twice is one job
    twice = [{"custom_id": "d", "image": f"s3://{own['MRC_S3_BUCKET']}/a.jpg", "prompt": "Q?"}] * 2
    other = {"custom_id": "d", "image": f"s3://{own['MRC_S3_BUCKET']}/b.jpg", "prompt": "Q?"}
    out = services.run_cli(own, "backlog", str(_write(tmp_path / "d.jsonl", [*twice, other])), "--strict")
    assert out.returncode == 2
    assert "line 3" in out.stderr
    assert "line 2" not in out.stderr
    assert _queued_ids(own) == []
    # the same job however a line names it: one image by two paths, the default max_new_tokens given
    # or not (review, helper-65: --strict refused what a plain run takes as one job)
    (tmp_path / "p.jpg").write_bytes(imagegen.photo(32, 32, seed=1))
    line = {"custom_id": "x", "image": str(tmp_path / "p.jpg"), "prompt": "Q?"}
    same = [line, {**line, "image": f"{tmp_path}/./p.jpg", "max_new_tokens": 64}]
    out = services.run_cli(own, "backlog", str(_write(tmp_path / "s.jsonl", same)), "--strict")
    assert out.returncode == 0, out.stderr
    assert len(_queued_ids(own)) == 1


def test_a_run_from_a_bucket_listing(own: dict[str, str]) -> None:
    s3 = boto3.client("s3", endpoint_url=own["MRC_S3_ENDPOINT_URL"], region_name="us-east-1")
    s3.create_bucket(Bucket=own["MRC_S3_BUCKET"])
    for i in range(300):
        s3.put_object(Bucket=own["MRC_S3_BUCKET"], Key=f"complaints/2026/{i:04d}.jpg", Body=b"x")
    s3.put_object(Bucket=own["MRC_S3_BUCKET"], Key="complaints/2025/old.jpg", Body=b"x")
    out = services.run_cli(own, "backlog", "--from-s3", f"s3://{own['MRC_S3_BUCKET']}/complaints/2026/",
                           "--prompt", "Refund?", "--run-id", "listing", "--interval", "0")  # fmt: skip
    assert out.returncode == 0, out.stderr
    queued = _queued_ids(own)
    assert len(queued) == 300
    assert manifest.job_id_for("listing", "complaints/2026/0007.jpg") in queued  # custom_id = the key
    # The listing is read page by page: the same run through pages of 50 keys finds them all again.
    backlog = Backlog(Client(services.settings_from_env(own)))
    backlog.files.page_size = 50  # type: ignore[attr-defined]  # the S3 implementation's page size
    assert sum(1 for _ in backlog.files.list_keys("complaints/2026/")) == 300
    # An object added since, sorting among the others, is queued by the same command again; each
    # object once (review, helper-65: it took a known object's line and was skipped, the last one
    # was indexed twice).
    s3.put_object(Bucket=own["MRC_S3_BUCKET"], Key="complaints/2026/0007b.jpg", Body=b"x")
    again = services.run_cli(own, "backlog", "--from-s3", f"s3://{own['MRC_S3_BUCKET']}/complaints/2026/",
                              "--prompt", "Refund?", "--run-id", "listing", "--interval", "0")  # fmt: skip
    assert again.returncode == 0, again.stderr
    queued = _queued_ids(own)
    assert len(queued) == len(set(queued)) == 301
    assert manifest.job_id_for("listing", "complaints/2026/0007b.jpg") in queued
    status = json.loads(services.run_cli(own, "backlog", "status", "listing", "--json").stdout)
    assert (status["lines"], status["jobs"]) == (301, 301)
    ids = [row["job_id"] for row in _file(own, "listing", "index/00000000.jsonl")]
    assert len(ids) == len(set(ids)) == 301
    # One question of every object: a pass asking another is refused and changes nothing (review,
    # helper-76: it rewrote the run's prompt, and the rest of the run asked the other question).
    other = services.run_cli(own, "backlog", "--resume", "listing", "--prompt", "Other?")
    assert other.returncode == 2, other.stderr
    assert "asks 'Refund?' of every object" in other.stderr
    record = redis_lib.Redis.from_url(own["MRC_REDIS_URL"], decode_responses=True)
    assert record.hget(names.run_record_key("listing"), "prompt") == "Refund?"


def test_runs_enqueued_at_once_through_one_backlog_queue_every_line_as_itself(own: dict[str, str]) -> None:
    """mrc-api enqueues several batches at once through one Backlog and so one kombu channel, whose
    capture is its own state: one thread ending its capture sent another's messages for real, outside
    the step that records them, and their lines were refused although their jobs ran (review, 2 of 4
    runs of 4-6 concurrent batches). Every line is queued once, as its own job, and indexed."""
    backlog = Backlog(Client(services.settings_from_env(own)))
    runs = {f"at-once-{n}": 150 for n in range(6)}

    def enqueue(run_id: str) -> int:
        rows = [
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "image": f"s3://{own['MRC_S3_BUCKET']}/p.jpg",
                    "prompt": f"{run_id} {i}?",
                }
            )
            for i in range(runs[run_id])
        ]
        return backlog.enqueue(((n + 1, row.encode()) for n, row in enumerate(rows)), run_id, "test").enqueued

    with ThreadPoolExecutor(len(runs)) as pool:
        queued = dict(zip(runs, pool.map(enqueue, runs), strict=True))
    assert queued == runs
    client = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    messages = [json.loads(m) for key in names.queue_keys("backlog") for m in client.lrange(key, 0, -1)]
    expected = {manifest.job_id_for(run_id, f"c{i}") for run_id, n in runs.items() for i in range(n)}
    assert len(messages) == len(expected)
    assert {m["headers"]["id"] for m in messages} == expected
    for m in messages:  # each message carries its own job, not a neighbour's
        body = json.loads(base64.b64decode(m["body"]))
        run_id, custom_id = m["headers"]["id"].split(".", 1)
        assert body[1]["job"]["prompt"] == f"{run_id} {custom_id[1:]}?"
    for run_id, n in runs.items():
        status = backlog.status(run_id)
        assert (status["queued"], status["invalid_lines"]) == (n, 0), status
    # A run minutes old shows its rate over its own time, not over a minute it has not had (review: 8
    # jobs done in 3 s read 0.13/s, the ETA 7 times too long).
    first = next(iter(runs))
    for i in range(30):
        client.hset(names.job_key(manifest.job_id_for(first, f"c{i}")), mapping={"state": "succeeded",
                    "updated_at": jobs.now_rfc3339()})  # fmt: skip
    assert backlog.status(first)["rate_per_s"] > 30 / 60


def test_a_run_waits_out_redis_away_and_ends_whole(own: dict[str, str], tmp_path: Path) -> None:
    """Review (helper-48): Redis restarted while `mrc backlog` waited for room in the lane, or while
    `--wait` waited, and it exited 5 ("nothing enqueued") with part or all of the run queued; a cron
    job's retry would have enqueued the run again under a new id. It waits the outage out, resumes
    its enqueue where it was, and ends with every job once."""
    redis_port = int(own["MRC_REDIS_URL"].rsplit(":", 1)[1].split("/")[0])
    proxy = Proxy(redis_port, services.free_port())
    proxy.start()
    through = {**own, "MRC_REDIS_URL": f"redis://127.0.0.1:{proxy.port}/0", "MRC_CONNECT_TIMEOUT_S": "0.5",
               "MRC_BACKLOG_MAX_DEPTH": "4"}  # fmt: skip
    _path, uri = _photo(Client(services.settings_from_env(own)), tmp_path, seed=12)
    rows = [{"custom_id": f"w{i}", "image": uri, "prompt": f"Q {i}?", "max_new_tokens": 10}
            for i in range(12)]  # fmt: skip
    manifest_file = _write(tmp_path / "m.jsonl", rows)
    records = redis_lib.Redis.from_url(own["MRC_REDIS_URL"], decode_responses=True)
    worker = None
    try:
        out_file, err_file = tmp_path / "producer.out", tmp_path / "producer.err"
        producer = services.start_cli(
            through, "backlog", str(manifest_file), "--run-id", "away", "--wait", "--interval", "0.2",
            stdout=out_file, stderr=err_file,
        )  # fmt: skip
        services.wait_for(lambda: len(_queued_ids(own)) == 4, 60, "the lane full", producer)
        proxy.stop()  # Redis away while the enqueue waits for room
        time.sleep(3)
        proxy.start()
        worker = services.start_worker({**own, "MRC_MODEL": "echo", "MRC_ECHO_TOKEN_MS": "150"},
                                        tmp_path / "worker.log")  # fmt: skip
        enqueued = lambda: records.hget(names.run_record_key("away"), "state") == "enqueued"  # noqa: E731
        services.wait_for(enqueued, 120, "the run enqueued", producer)
        proxy.stop()  # and while --wait waits: the worker, on Redis itself, goes on
        time.sleep(3)
        proxy.start()
        code = producer.wait(180)
        out, err = out_file.read_text(), err_file.read_text()
    finally:
        if worker is not None:
            worker.stop()
        proxy.close()
        records.close()
    assert code == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["counts"].get("succeeded") == 12, report
    assert "trying again" in err
    results = _file(own, "away", "results.jsonl")
    assert sorted(r["custom_id"] for r in results) == sorted(f"w{i}" for i in range(12))
    assert {r["status"] for r in results} == {"succeeded"}


def test_an_upload_that_meets_s3_away_is_waited_out_not_a_line_refused(
    own: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (helper-50): a local photo whose upload met an S3 blip made its line invalid for good
    (indexed so; a resume kept it), the run exiting 1. The blip is raised, and the enqueue, tried
    again as `mrc backlog` does, queues every line once."""
    backlog = Backlog(Client(services.settings_from_env(own)))
    real, calls = backlog.intake.upload_image, []

    def blip(path: Path) -> tuple[str, str]:
        calls.append(path)
        if len(calls) == 1:
            raise StoreUnavailable("S3 put_object failed: Could not connect to the endpoint URL")
        return real(path)

    monkeypatch.setattr(backlog.intake, "upload_image", blip)
    rows = []
    for i in range(3):
        photo = tmp_path / f"p{i}.jpg"
        photo.write_bytes(imagegen.photo(64, 48, seed=20 + i))
        rows.append({"custom_id": f"u{i}", "image": str(photo), "prompt": "Q?"})
    manifest_file = _write(tmp_path / "m.jsonl", rows)

    def enqueue() -> Any:
        with manifest_file.open("rb") as handle:
            return backlog.enqueue(manifest.read_lines(handle), "blip", str(manifest_file))

    progress = outages.outlast(enqueue, 60, "testing", sleep=lambda _s: None)
    assert (progress.enqueued, progress.invalid) == (3, 0)
    assert sorted(_queued_ids(own)) == [f"blip.u{i}" for i in range(3)]


def test_cancel_ends_the_runs_waiting_jobs_as_cancelled(own: dict[str, str], tmp_path: Path) -> None:
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": "Q?"}
        for i in range(10)
    ]
    manifest_file = _write(tmp_path / "m.jsonl", rows)
    assert services.run_cli(own, "backlog", str(manifest_file), "--run-id", "stop").returncode == 0
    out = services.run_cli(own, "backlog", "cancel", "stop")
    assert json.loads(out.stdout) == {"run_id": "stop", "cancelled": 10}
    # Before a worker ends them, status says they are cancelled (review: "10 queued", as if to run)
    status = json.loads(services.run_cli(own, "backlog", "status", "stop", "--json").stdout)
    assert (status["jobs"], status["queued"], status["cancelling"], status["state"]) == (
        10,
        10,
        10,
        "cancelled",
    )
    said = services.run_cli(own, "backlog", "status", "stop").stdout
    assert "0/10 done" in said  # each job once (review: the cancelling were counted again, 0/20)
    assert "10 queued (10 of them cancelled, to end so)" in said
    worker = services.start_worker({**own, "MRC_MODEL": "echo"}, tmp_path / "worker.log")
    try:
        client = Client(services.settings_from_env(own))
        for i in range(10):
            result = client.wait(f"stop.c{i}", 60)
            assert result["status"] == "failed"
            assert result["error"]["code"] == "cancelled"
    finally:
        worker.stop()
    report = services.run_cli(own, "backlog", "report", "stop")
    assert report.returncode == 1
    assert json.loads(report.stdout)["failed_by_code"] == {"cancelled": 10}
    assert json.loads(services.run_cli(own, "backlog", "status", "stop", "--json").stdout)["cancelling"] == 0
    again = services.run_cli(own, "backlog", str(manifest_file), "--run-id", "stop")
    assert again.returncode == 2
    assert "cancelled" in again.stderr


def test_a_backlog_run_does_not_hold_back_interactive_tickets(
    env: dict[str, str], worker: services.Worker, client: Client, tmp_path: Path
) -> None:
    _photo_path, uri = _photo(client, tmp_path, seed=9)
    rows = [
        {"custom_id": f"c{i}", "image": uri, "prompt": f"Backlog {i}?", "max_new_tokens": 16}
        for i in range(200)
    ]
    events = redis_lib.Redis.from_url(env["MRC_REDIS_URL"], decode_responses=True)
    newest = events.xrevrange(names.events_key(), count=1)
    mark = newest[0][0] if newest else "0"
    # The worker is held while the run and then the ticket are queued: the whole run is ahead of the
    # ticket in time, on a machine of any speed (a fast worker could otherwise have finished the run
    # before the ticket came, and a slow CLI could have sent the ticket before most of the run).
    try:
        with worker.held():
            out = services.run_cli(
                env, "backlog", str(_write(tmp_path / "m.jsonl", rows)), "--run-id", "prio"
            )
            assert out.returncode == 0, out.stderr
            # The photo is in S3 already (`uri`): the ticket's wait is the queue's, not an upload's.
            ticket = client.submit(uri, "Urgent: can I get a refund?", job_id=f"urgent-{time.monotonic_ns()}",
                                   max_new_tokens=4)  # fmt: skip
        _ticket_goes_first(client, events, mark, ticket)
    finally:
        services.run_cli(env, "backlog", "cancel", "prio")  # the rest end at once, not in later tests' way


def _ticket_goes_first(client: Client, events: redis_lib.Redis, mark: str, ticket: str) -> None:
    result = client.wait(ticket, 120)
    assert result["status"] == "succeeded"
    # Counted in the order jobs ended (the fleet's event stream), not by a clock: before the ticket's
    # end, the backlog can have finished what the worker held when it came ((MRC_WORKER_DELIVERIES -
    # 1) x MRC_BATCH_MAX_JOBS = 32; a pop pending at the stop took one), a delivery more (16), and the
    # rows that shared the ticket's four steps. A ticket that waited its turn would come after all 200.
    ended = _events_through(events, mark, ticket)
    before = len(ended) - 1
    backlog_first = sum(e[1]["lane"] == "backlog" for e in ended[:before])
    assert backlog_first <= 64, f"{backlog_first} backlog jobs ended before the ticket"


def _events_through(events: redis_lib.Redis, mark: str, job_id: str) -> list[tuple[str, dict[str, str]]]:
    """The fleet's completion events after `mark` up to the job's own. The wait returns once the
    result is stored, and the finisher announces the event last (workers/finisher.py), so it may
    come a moment after: read until it does."""
    ended: list[tuple[str, dict[str, str]]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        reply = events.xread({names.events_key(): ended[-1][0] if ended else mark}, count=1000, block=1000)
        for _stream, entries in reply or []:
            for entry in entries:
                ended.append(entry)
                if entry[1]["job_id"] == job_id:
                    return ended
    raise AssertionError(f"no completion event for {job_id} in 60 s")


def test_a_results_file_bigger_than_a_part_is_streamed_in_parts(own: dict[str, str]) -> None:
    """results.jsonl of a big run: uploaded part by part as lines come (multipart), read back whole;
    a stream that fails half-way leaves no object (and no parts) behind."""
    files = open_run_files(services.settings_from_env(own))
    Client(services.settings_from_env(own)).results.ensure_bucket()
    line = json.dumps({"custom_id": "c", "text": "x" * 1000}) + "\n"
    count = 20_000  # ~20 MB: three parts of 8 MiB
    files.write_lines("runs/big/results.jsonl", (line for _ in range(count)))
    text = files.get_text("runs/big/results.jsonl") or ""
    assert text.count("\n") == count
    assert text == line * count

    def broken() -> Iterator[str]:
        for n in range(count):
            if n == 15_000:
                raise OSError("the producer's disk went away")
            yield line

    with pytest.raises(OSError, match="disk went away"):
        files.write_lines("runs/big/broken.jsonl", broken())
    assert files.get_text("runs/big/broken.jsonl") is None
    s3 = boto3.client("s3", endpoint_url=own["MRC_S3_ENDPOINT_URL"], region_name="us-east-1")
    assert not s3.list_multipart_uploads(Bucket=own["MRC_S3_BUCKET"]).get("Uploads")


def test_the_lane_exporter_serves_depth_in_flight_and_age_without_a_worker(
    own: dict[str, str], tmp_path: Path
) -> None:
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/x.jpg", "prompt": "Q?"}
        for i in range(5)
    ]
    before = time.time()
    assert services.run_cli(own, "backlog", str(_write(tmp_path / "m.jsonl", rows))).returncode == 0
    after = time.time()
    port = services.free_port()
    proc = services.start_cli(own, "queues", "--serve-metrics", str(port))
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape() -> str:
            import urllib.request

            with urllib.request.urlopen(url, timeout=5) as reply:
                return str(reply.read().decode())

        services.wait_for(lambda: _can(scrape), 30, "the exporter", proc)
        text, scraped = scrape(), time.time()
        assert 'mrc_queue_depth{lane="backlog"} 5.0' in text
        assert 'mrc_queue_in_flight{lane="backlog"} 0.0' in text
        age = next(
            line
            for line in text.splitlines()
            if line.startswith('mrc_queue_oldest_age_seconds{lane="backlog"}')
        )
        # Bounded on both sides by the clock around the enqueue (the code clamps at 0: ">= 0" could
        # not fail): the oldest job was submitted between `before` and `after`.
        assert scraped - after - 0.01 <= float(age.split()[-1]) <= time.time() - before + 0.01
        assert "mrc_queue_metrics_up 1.0" in text
        # The run just enqueued is going (no worker): the exporter reads the runs (review, helper-99)
        assert 'mrc_backlog_runs_active{kind="backlog"} 1.0' in text
        assert 'mrc_backlog_runs_active{kind="batch"} 0.0' in text
        assert "mrc_rejected_total " in text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    asked = time.time()
    view = json.loads(services.run_cli(own, "queues", "--json").stdout)
    assert view["lanes"]["backlog"] == 5
    assert view["in_flight"] == {"interactive": 0, "backlog": 0}
    assert asked - after - 0.06 <= view["oldest_age_s"]["backlog"] <= time.time() - before + 0.06  # rounded


def _can(probe: Any) -> bool:
    try:
        probe()
    except OSError:
        return False
    return True


def test_a_cancel_while_the_run_waits_for_room_queues_nothing_more(
    own: dict[str, str], tmp_path: Path
) -> None:
    """The run fills the lane to its limit and waits for room; a cancel then stops it at once: not one
    more job is queued, the run stays cancelled (no resume), and every job it queued ends cancelled,
    also those whose cancel mark never got written (a producer killed before it marked them)."""
    env = {**own, "MRC_BACKLOG_MAX_DEPTH": "50"}
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": "Q?"}
        for i in range(80)
    ]
    manifest_file = _write(tmp_path / "m.jsonl", rows)
    err = tmp_path / "enqueue.err"
    proc = services.start_cli(
        env, "backlog", str(manifest_file), "--run-id", "halt", "--interval", "0", stderr=err
    )
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    services.wait_for(lambda: "waiting for room" in err.read_text(), 60, "the run to wait for room", proc)
    assert lane.llen(names.queue_name("backlog")) == 50, "parts shrink to the room left"
    # What a waiting run queued is the run's before its chunk ends (review, helper-72: 0/0 until then).
    waiting = json.loads(services.run_cli(env, "backlog", "status", "halt", "--json").stdout)
    assert (waiting["state"], waiting["jobs"], waiting["queued"]) == ("enqueuing", 50, 50)
    cancel = services.run_cli(env, "backlog", "cancel", "halt")
    assert cancel.returncode == 0, cancel.stderr
    assert json.loads(cancel.stdout)["cancelled"] == 50, "cancel saw none of the waiting chunk's jobs"
    assert proc.wait(30) == 2, err.read_text()
    assert "cancelled while it was being enqueued" in err.read_text()
    assert lane.llen(names.queue_name("backlog")) == 50
    status = json.loads(services.run_cli(env, "backlog", "status", "halt", "--json").stdout)
    assert status["state"] == "cancelled"
    assert status["queued"] == status["cancelling"] == 50  # marked by the enqueue it stopped, too
    assert services.run_cli(env, "backlog", "--resume", "halt").returncode == 2
    ids = _queued_ids(own)
    assert all(lane.hget(names.job_key(job_id), "cancelled") == b"1" for job_id in ids)
    for job_id in ids[:5]:  # as if the producer had been killed before it marked them
        lane.hdel(names.job_key(job_id), "cancelled")
    worker = services.start_worker({**env, "MRC_MODEL": "echo"}, tmp_path / "worker.log")
    try:
        client = Client(services.settings_from_env(own))
        codes = {client.wait(job_id, 60)["error"]["code"] for job_id in ids}
    finally:
        worker.stop()
    assert codes == {"cancelled"}


def test_wait_timeout_bounds_the_wait_for_room_too(own: dict[str, str], tmp_path: Path) -> None:
    """Review, helper-110: `--wait --timeout 3` on a full lane waited for room 639 s (until Ctrl-C):
    the timeout bounded only the wait for results. It now bounds the whole --wait: exit 3, naming the
    resume, what went in the run's (status sees it)."""
    env = {**own, "MRC_BACKLOG_MAX_DEPTH": "40"}
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": "Q?"}
        for i in range(100)
    ]
    path = str(_write(tmp_path / "m.jsonl", rows))
    done = services.run_cli(env, "backlog", path, "--wait", "--timeout", "2", "--run-id", "late", timeout=90)
    assert done.returncode == 3, done.stderr
    assert "not whole after 2 s (waiting for room on the backlog lane" in done.stderr
    # The message is the last line (review, helper-111: the last progress line came after it).
    assert "mrc backlog --resume late" in done.stderr.strip().splitlines()[-1]
    assert len(_queued_ids(own)) == 40
    status = json.loads(services.run_cli(own, "backlog", "status", "late", "--json").stdout)
    assert (status["jobs"], status["queued"]) == (40, 40)
    # Those 40 ended, 60 lines never queued: neither its own rate nor an ETA of 0 (helper-111).
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    for job_id in _queued_ids(own):
        lane.hset(names.job_key(job_id), mapping={"state": "succeeded", "updated_at": jobs.now_rfc3339()})
    status = json.loads(services.run_cli(own, "backlog", "status", "late", "--json").stdout)
    assert (status["state"], status["succeeded"], status["eta_s"]) == ("enqueuing", 40, None)
    # --rate's pacing is bounded too (review, helper-111: --rate 1 over 100,000 lines ran 28 h past it).
    paced = services.run_cli(
        own, "backlog", path, "--wait", "--timeout", "2", "--rate", "5", "--run-id", "paced", timeout=90
    )
    assert paced.returncode == 3, paced.stderr
    assert "not whole after 2 s (pacing its lines at --rate 5 a second)" in paced.stderr
    status = json.loads(services.run_cli(own, "backlog", "status", "paced", "--json").stdout)
    assert 0 < status["jobs"] < 100


def test_a_finished_runs_rate_is_its_own_not_one_that_falls_with_time(
    own: dict[str, str], tmp_path: Path
) -> None:
    """Review, helper-110: a run of 3 jobs done in 0.4 s read 2.68/s at its end, 0.68/s a few seconds
    later and 0.57/s after that: the last minute's count over the time since its start."""
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": "Q?"}
        for i in range(3)
    ]
    assert (
        services.run_cli(
            own, "backlog", str(_write(tmp_path / "m.jsonl", rows)), "--run-id", "brief"
        ).returncode
        == 0
    )
    lane = redis_lib.Redis.from_url(own["MRC_REDIS_URL"])
    created = jobs.parse_rfc3339(
        json.loads(services.run_cli(own, "backlog", "status", "brief", "--json").stdout)["created_at"]
    )
    for n, job_id in enumerate(
        sorted(_queued_ids(own))
    ):  # as a worker ends them: 1, 2 and 3 s after its start
        ended = (created + timedelta(seconds=n + 1)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        lane.hset(names.job_key(job_id), mapping={"state": "succeeded", "updated_at": ended})
    status = json.loads(services.run_cli(own, "backlog", "status", "brief", "--json").stdout)
    assert status["succeeded"] == 3
    assert status["rate_per_s"] == 1.0  # 3 jobs from its start to its last end, 3 s
    assert status["eta_s"] == 0


def test_the_depth_limit_holds_when_it_is_below_a_part(own: dict[str, str], tmp_path: Path) -> None:
    """A limit of 40 with parts of 500: exactly 40 jobs go in (it used to let a whole part in). What
    went in is the run's (review, helper-63: status read 0/0 and cancel found nothing), and a resume
    once there is room queues the rest, each line once."""
    env = {**own, "MRC_BACKLOG_MAX_DEPTH": "40"}
    rows = [
        {"custom_id": f"c{i}", "image": f"s3://{own['MRC_S3_BUCKET']}/none.jpg", "prompt": "Q?"}
        for i in range(240)
    ]
    rows.insert(100, "")  # a blank line is no line to queue, on either pass
    done = services.run_cli(
        env, "backlog", str(_write(tmp_path / "m.jsonl", rows)), "--no-block", "--run-id", "full"
    )
    assert done.returncode == 4, done.stderr
    assert "mrc backlog --resume full" in done.stderr
    assert len(_queued_ids(own)) == 40
    status = json.loads(services.run_cli(own, "backlog", "status", "full", "--json").stdout)
    assert (status["jobs"], status["queued"]) == (40, 40)
    resumed = services.run_cli(own, "backlog", "--resume", "full", "--interval", "0")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(_queued_ids(own)) == sorted(f"full.c{i}" for i in range(240))
    status = json.loads(services.run_cli(own, "backlog", "status", "full", "--json").stdout)
    assert (status["lines"], status["jobs"], status["queued"]) == (241, 240, 240)
