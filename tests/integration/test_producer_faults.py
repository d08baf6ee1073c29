"""The producer's side of "never lose a job": interrupted submits, reused ids, dead-letter requeues
and waits, against the session's real Redis and S3 (no worker: each test plays the worker's part)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from producer.client import Client, Submission
from producer.queue import dlq
from scripts import devservices as services
from shared import backlog_share, names
from shared.errors import UsageError
from shared.records import RedisJobRecords, connect
from tests.support import imagegen, looks

pytestmark = pytest.mark.integration


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "p.jpg"
    path.write_bytes(imagegen.photo(64, 48))
    return path


def _id() -> str:
    return f"pf-{uuid.uuid4().hex[:10]}"


def _ran(client: Client, job_id: str) -> bool:
    """The job's message really reached the queue: the session's worker ran it."""
    return client.wait(job_id, timeout=60)["status"] == "succeeded"


class Interrupted:
    """A publish that is interrupted (Ctrl-C) or fails, then works again."""

    def __init__(self, client: Client, error: BaseException) -> None:
        self.real, self.error = client.sends.send, error
        client.sends.send = self  # type: ignore[method-assign]  # the fault injected

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ConnectionError("broker gone"), SystemExit(1)])
def test_an_interrupted_submit_frees_its_job_id(
    client: Client, worker: services.Worker, image: Path, error: BaseException
) -> None:
    job = client.build_job(Submission(image=image, prompt="refund?", job_id=_id()))
    interrupted = Interrupted(client, error)
    with pytest.raises(type(error)):
        client.enqueue(job)
    assert client.records.get(job.job_id) == {}, "the claim was undone"
    client.sends.send = interrupted.real  # type: ignore[method-assign]  # the fault injected
    assert client.enqueue(job) is True
    assert _ran(client, job.job_id)


def test_a_claim_whose_producer_died_before_publishing_frees_itself(
    client: Client, worker: services.Worker, image: Path, env: dict[str, str]
) -> None:
    records = RedisJobRecords(connect(services.settings_from_env(env)), claim_ttl_s=1)
    job = client.build_job(Submission(image=image, prompt="refund?", job_id=_id()))
    assert records.claim(job.job_id, job.lane, job.fingerprint())  # ...and the producer was SIGKILLed
    # A live claim not yet published is waited out, never answered "same job": it may never be sent.
    assert client.enqueue(job) is True
    assert int(client.records._redis.ttl(names.job_key(job.job_id))) > 24 * 3600, "confirmed for a week"
    assert _ran(client, job.job_id)


def test_a_different_job_under_a_used_id_is_refused(client: Client, image: Path) -> None:
    job_id = _id()
    assert client.enqueue(client.build_job(Submission(image=image, prompt="refund?", job_id=job_id)))
    assert not client.enqueue(client.build_job(Submission(image=image, prompt="refund?", job_id=job_id)))
    with pytest.raises(UsageError, match="different job"):
        client.enqueue(client.build_job(Submission(image=image, prompt="other?", job_id=job_id)))


def test_a_used_id_stays_used_after_its_record_expired(client: Client, image: Path) -> None:
    job = client.build_job(Submission(image=image, prompt="refund?", job_id=_id()))
    result = {"job_id": job.job_id, "status": "succeeded", "job_fingerprint": job.fingerprint()}
    client.results.put_result(job.job_id, result)  # ran a week ago; the record is gone
    assert client.enqueue(job) is False
    assert client.records.get(job.job_id) == {}
    other = job.model_copy(update={"prompt": "something else"})
    with pytest.raises(UsageError, match="different job"):
        client.enqueue(other)
    assert client.records.get(job.job_id) == {}
    assert client.result(job.job_id) == result


def _dead_letter(client: Client, raw: str) -> None:
    client.records._redis.lpush(names.dead_letter_key(), raw)


def test_dlq_requeue_keeps_invalid_entries_and_sends_the_rest(
    client: Client, worker: services.Worker, image: Path
) -> None:
    client.records.purge_dead_letters()
    job = client.build_job(Submission(image=image, prompt="refund?", job_id=_id()))
    client.records.set_state(job.job_id, "failed", dead_letter="1")
    entries = ["{not json", json.dumps({"job": {"job_id": "x"}}), json.dumps({"job": job.to_message()})]
    for raw in entries:
        _dead_letter(client, raw)
    for raw in ("[1, 2]", "NaN", "[" * 100_000):  # JSON, but no entry at all; too deep for the parser
        _dead_letter(client, raw)
    assert dlq.requeue(client, 100) == (1, 5, 0)
    kept = ["{not json", json.dumps({"job": {"job_id": "x"}}), "[1, 2]", "NaN", "[" * 100_000]
    assert sorted(client.records._redis.lrange(names.dead_letter_key(), 0, -1)) == sorted(kept)
    assert client.records._redis.llen(names.dead_letter_processing_key()) == 0
    assert _ran(client, job.job_id)
    # What the runbook sends a person to look at, the list shows, newest first (review: a traceback)
    listed = client.records.dead_letters(100)
    assert [e.get("raw") for e in listed] == ["[" * 2000, "NaN", "[1, 2]", None, "{not json"]
    assert [e.get("invalid") for e in listed].count("not a JSON object") == 4
    assert listed[3] == {"job": {"job_id": "x"}}


def test_dlq_requeue_of_a_job_submitted_minutes_ago_runs_it_again(
    client: Client, worker: services.Worker, image: Path
) -> None:
    """A submission leaves its push marker for an hour (a lost reply is answered truthfully); a
    requeue is a new push, not that submission's retry: it must reach the queue."""
    client.records.purge_dead_letters()
    job = client.build_job(Submission(image=image, prompt="refund?", job_id=_id()))
    assert client.enqueue(job) is True
    assert _ran(client, job.job_id)
    first = client.result(job.job_id)
    client.records.set_state(job.job_id, "failed", dead_letter="1")
    _dead_letter(client, json.dumps({"job": job.to_message()}))
    assert dlq.requeue(client, 10) == (1, 0, 0)
    deadline = time.monotonic() + 60
    while client.result(job.job_id) == first:  # the second run writes a new result object
        assert time.monotonic() < deadline, "the requeued job never ran"
        time.sleep(0.1)
    assert _ran(client, job.job_id)


def test_dlq_requeue_that_cannot_send_loses_nothing(
    client: Client, worker: services.Worker, image: Path
) -> None:
    client.records.purge_dead_letters()
    job = client.build_job(Submission(image=image, prompt="refund?", job_id=_id()))
    raw = json.dumps({"job": job.to_message()})
    _dead_letter(client, raw)
    interrupted = Interrupted(client, ConnectionError("broker gone"))
    with pytest.raises(ConnectionError):
        dlq.requeue(client, 10)
    assert client.records._redis.lrange(names.dead_letter_key(), 0, -1) == [raw]
    assert client.records.get(job.job_id)["state"] == "failed", "no record claims a queued message"
    # A requeue killed between taking an entry and sending it leaves it in the processing list:
    assert client.records.take_dead_letter() == raw
    client.sends.send = interrupted.real  # type: ignore[method-assign]  # the fault injected
    assert dlq.requeue(client, 10) == (1, 0, 0)
    assert _ran(client, job.job_id)


def test_wait_finds_a_result_whose_record_update_was_lost(client: Client) -> None:
    job_id = _id()
    client.records.claim(job_id, "interactive")
    client.records.begin(job_id)  # the record says running...
    client.results.put_result(job_id, {"job_id": job_id, "status": "succeeded"})  # ...the result is stored
    began = time.monotonic()
    assert client.wait(job_id, timeout=10)["status"] == "succeeded"
    assert time.monotonic() - began < 3


def test_wait_reports_a_job_whose_result_could_not_be_stored(client: Client, env: dict[str, str]) -> None:
    job_id = _id()
    client.records.claim(job_id, "interactive")
    client.records.set_state(
        job_id, "failed", dead_letter="1", error_code="internal_error",
        error_message="the result could not be stored",
    )  # fmt: skip
    result = client.wait(job_id, timeout=10)
    assert result["status"] == "failed"
    assert result["error"]["code"] == "internal_error"
    assert result["result_stored"] is False


class Sends:
    """Counts the messages a client really publishes."""

    def __init__(self, client: Client) -> None:
        self.count, self.real = 0, client.sends.send
        client.sends.send = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        return self.real(*args, **kwargs)


def test_a_claim_that_expires_during_the_result_check_is_never_sent_on(
    client: Client, worker: services.Worker, image: Path, env: dict[str, str]
) -> None:
    """The look for an earlier result (an S3 HEAD, up to minutes with retries) outlasts the claim; in
    the meantime another producer claims and sends the same job. The first must not send it again,
    nor confirm a record it no longer holds."""
    job = client.build_job(Submission(image=image, prompt="refund?", job_id=_id()))
    slow = Client(services.settings_from_env(env))
    other_sends, slow_sends = Sends(client), Sends(slow)
    real_has_result = slow.results.has_result
    outcome: list[bool] = []

    def has_result(job_id: str) -> bool:
        if not outcome:  # the first look: the lease runs out, and the other producer goes ahead
            slow.records._redis.delete(names.job_key(job_id))  # type: ignore[attr-defined]  # expiry
            outcome.append(client.enqueue(job))
        return real_has_result(job_id)

    slow.results.has_result = has_result  # type: ignore[method-assign]
    assert slow.enqueue(job) is False  # the other's published submission: the same job
    assert outcome == [True]
    assert (other_sends.count, slow_sends.count) == (1, 0)
    record = client.records.get(job.job_id)
    assert (record["published"], record["lane"], record["fingerprint"]) == (
        "1",
        "interactive",
        job.fingerprint(),
    )
    assert "claim" not in record
    assert _ran(client, job.job_id)


def test_a_confirm_for_a_claim_no_longer_held_writes_nothing(client: Client) -> None:
    job_id = _id()
    token = client.records.claim(job_id, "interactive")
    assert token is not None
    client.records._redis.delete(names.job_key(job_id))  # type: ignore[attr-defined]  # it expired
    assert client.records.confirm(job_id, token) is False
    assert client.records.get(job_id) == {}, "a record with only published/checked would 404 the job"
    other = client.records.claim(job_id, "interactive")
    assert other is not None
    client.records.release(job_id, token)  # the old holder's undo leaves the new claim alone
    assert client.records.get(job_id)["claim"] == other


def test_a_claim_sent_again_with_its_own_token_is_still_its_holders(client: Client) -> None:
    """A claim whose answer was lost (a timeout, a dropped connection) and that redis-py sends again
    finds the record it made itself: its holder's, not another submission's (review, helper-74: the
    submission then waited out its own claim and was answered 503 naming S3)."""
    claim = client.records._claim  # type: ignore[attr-defined]  # the script, as redis-py resends it
    for lane, limit in (("interactive", ""), ("backlog", 10_000)):  # a backlog claim takes room once
        job_id = _id()
        keys = [names.job_key(job_id), *backlog_share.keys(), *names.queue_keys(lane)]
        stamp, now = "2026-12-06T00:00:00Z", time.time()
        args = [30, lane, stamp, "fp", "token-one", "-", now, 86400, limit, "1", job_id]
        assert claim(keys=keys, args=args)[0] == 1  # (on the backlog, with the room before it)
        assert claim(keys=keys, args=args) == [1], "its own claim, sent again"
        assert claim(keys=keys, args=[*args[:4], "token-two", *args[5:]]) == [0]
        claims = client.records._redis.zrange(names.backlog_claims_key(), 0, -1)  # type: ignore[attr-defined]
        assert claims.count(f"- {job_id}") == (lane == "backlog")


def test_a_look_for_an_earlier_result_that_hangs_is_cut_well_inside_the_claim(
    client: Client, worker: services.Worker, image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 that accepts and never answers: the producer stops looking after a third of the claim's
    lease and sends the job unchecked (its record tells the worker to look), instead of outliving it."""
    import threading

    from producer.queue import sender as client_module

    monkeypatch.setattr(client_module, "CLAIM_TTL_S", 3)
    hung = threading.Event()

    def has_result(job_id: str) -> bool:
        hung.wait(30)
        return False

    monkeypatch.setattr(client.results, "has_result", has_result)
    renewals: list[bool] = []
    real_renew = client.records.renew

    def renew(job_id: str, token: str) -> bool:
        renewals.append(real_renew(job_id, token))
        return renewals[-1]

    monkeypatch.setattr(client.records, "renew", renew)
    job = client.build_job(Submission(image=image, prompt="refund?", job_id=_id()))
    try:
        assert client.enqueue(job) is True
    finally:
        hung.set()
    assert renewals == [True], "the look outlived the claim"
    assert client.records.get(job.job_id)["checked"] == "0"
    assert _ran(client, job.job_id)


def test_a_job_id_drawn_for_the_submission_is_sent_without_asking_s3(
    client: Client, worker: services.Worker, image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A HEAD a submission was the intake's largest cost (docs/benchmarks.md, HTTP intake). An id the
    producer drew for the job is no earlier job's: S3 is not asked and the record says the id was
    checked (the worker does not look either). An id the caller named is still looked up once."""
    looked = looks.counted(client.results, monkeypatch)
    drawn = client.submit(image, "refund?")
    assert looked == []
    assert client.records.get(drawn)["checked"] == "1"
    named = client.submit(image, "refund?", job_id=_id())
    assert looked == [named]
    assert client.records.get(named)["checked"] == "1"
    many = client.submit_many(
        [Submission(image=image, prompt="refund?"), Submission(image=image, prompt="why?")]
    )
    assert looked == [named]
    assert len(set(many)) == 2
    assert all(_ran(client, job_id) for job_id in (drawn, named, *many))
