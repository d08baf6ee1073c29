"""The pipeline over the in-process seams: EchoBackend, MemoryStore, MemoryJobRecords."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from shared.errors import StoreUnavailable
from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from workers.backends.echo import EchoBackend
from workers.pipeline import Pipeline, assemble
from workers.slots import Message


@pytest.fixture
def store() -> MemoryStore:
    s = MemoryStore("mrc")
    s.put_bytes("inputs/good.jpg", imagegen.photo(64, 48), "image/jpeg")
    s.put_bytes("inputs/bad.jpg", imagegen.truncated_jpeg(), "image/jpeg")
    return s


def _job(job_id: str, prompt: str = "refund?", image: str = "s3://mrc/inputs/good.jpg", **kw: Any) -> Message:
    body = {"job_id": job_id, "image_uri": image, "prompt": prompt, "max_new_tokens": 8, **kw}
    return Message(job_id, body)


class Requeued(list[tuple[str, object, float]]):
    def __call__(self, request_id: str, body: object, delay: float) -> None:
        self.append((request_id, body, delay))


def _pipeline(
    store: MemoryStore,
    backend: EchoBackend | None = None,
    records: MemoryJobRecords | None = None,
    requeue: Requeued | None = None,
    **settings: Any,
) -> Pipeline:
    return assemble(
        backend or EchoBackend(),
        store,
        store,
        records or MemoryJobRecords(),
        Settings(**settings),
        sleep=lambda _s: None,
        requeue=Requeued() if requeue is None else requeue,
    )


def test_one_result_per_job_and_bad_jobs_fail_alone(store: MemoryStore) -> None:
    messages = [
        _job("ok-1"),
        _job("bad-image", image="s3://mrc/inputs/bad.jpg"),
        _job("missing", image="s3://mrc/inputs/nope.jpg"),
        _job("forbidden", image="s3://secret/x.jpg"),
        Message("garbage", {"not": "a job"}),
        Message("weird id !", None),
        _job("expired", deadline="2000-01-01T00:00:00Z"),
        _job("bad-deadline", deadline="next week"),
        _job("ok-2", prompt="这是什么"),
    ]
    outcomes = _pipeline(store).run(messages)
    assert outcomes == ["succeeded"] + ["failed"] * 7 + ["succeeded"]
    codes = {}
    for key in [k for (_b, k) in store.objects if k.startswith("results/")]:
        result = store.get_result(key[len("results/") : -len(".json")])
        assert result is not None
        codes[result["job_id"]] = result["error"]["code"] if result["error"] else None
    assert len(codes) == len(messages)
    assert codes["ok-1"] is None
    assert codes["ok-2"] is None
    assert codes["bad-image"] == "image_decode_error"
    assert codes["missing"] == "image_not_found"
    assert codes["forbidden"] == "image_source_forbidden"
    assert codes["garbage"] == "invalid_job"
    assert codes["expired"] == "expired"
    assert codes["bad-deadline"] == "invalid_job"
    assert [v for k, v in codes.items() if k.startswith("invalid-")] == ["invalid_job"]
    assert store.get_result("ok-2")["text"] == "64x48: 这是什么"


def test_a_poison_job_that_breaks_the_model_fails_alone(store: MemoryStore) -> None:
    backend = EchoBackend(fail_on="POISON")
    messages = [_job(f"j{i}") for i in range(5)] + [_job("poison", prompt="POISON please")]
    outcomes = _pipeline(store, backend).run(messages)
    assert outcomes == ["succeeded"] * 5 + ["failed"]
    assert store.get_result("poison")["error"]["code"] == "model_error"
    # the poison one failed by itself: a prefill call of several rows that fails runs each row alone,
    # so the poison ran alone and its neighbours' prefills ran once more at most
    assert ["POISON please"] in backend.prefill_calls
    assert backend.prefills.count("POISON please") <= 2
    assert backend.prefills.count("refund?") <= 10


def test_out_of_memory_splits_then_retries_then_dead_letters(store: MemoryStore) -> None:
    from shared.errors import OutOfMemory

    backend = EchoBackend(fail_on="HUGE", error=OutOfMemory("CUDA out of memory"))
    records, requeued = MemoryJobRecords(), Requeued()
    pipeline = _pipeline(store, backend, records, requeued, max_attempts=3, retry_base_s=1.0)
    outcomes = pipeline.run([_job("a"), _job("huge", prompt="HUGE"), _job("b")])
    assert outcomes == ["succeeded", "retry", "succeeded"]
    assert store.get_result("huge") is None
    assert records.get("huge")["state"] == "queued"
    assert [r[0] for r in requeued] == ["huge"]
    assert 0.5 <= requeued[0][2] <= 1.5
    assert pipeline.run([_job("huge", prompt="HUGE")]) == ["retry"]
    assert 1.0 <= requeued[1][2] <= 3.0  # the delay doubles, with jitter
    assert pipeline.run([_job("huge", prompt="HUGE")]) == ["failed"]
    result = store.get_result("huge")
    assert result["error"]["code"] == "out_of_memory"
    assert result["error"]["retryable"] is True
    assert result["attempts"] == 3
    assert len(requeued) == 2
    assert [(e["job_id"], e["code"], e["attempts"]) for e in records.dlq] == [("huge", "out_of_memory", 3)]


def test_a_jobs_completion_event_comes_after_everything_else_its_end_writes(store: MemoryStore) -> None:
    """The event wakes the waits for the job (Client.wait, mrc-api's long-polls): what a caller may look
    at once woken (the result, the record, the dead letter, the job's metrics) is written before it."""
    from shared.errors import OutOfMemory

    seen: dict[str, tuple[Any, ...]] = {}

    class Watching(MemoryJobRecords):
        def add_event(self, event: dict[str, str], keep: int) -> str:
            job_id = event["job_id"]
            seen[job_id] = (
                store.get_result(job_id) is not None,
                self.get(job_id).get("state"),
                [e["job_id"] for e in self.dlq],
                _jobs_counted(pipeline, "succeeded" if job_id == "fine" else "failed"),
            )
            return super().add_event(event, keep)

    backend = EchoBackend(fail_on="HUGE", error=OutOfMemory("CUDA out of memory"))
    records = Watching()
    pipeline = _pipeline(store, backend, records, max_attempts=1)
    assert pipeline.run([_job("fine"), _job("huge", prompt="HUGE")]) == ["succeeded", "failed"]
    # Each job's own count (by its outcome: the two ends are written on two threads, in either order)
    assert seen["fine"] == (True, "succeeded", [], 1.0)
    assert seen["huge"] == (True, "failed", ["huge"], 1.0)


def _jobs_counted(pipeline: Pipeline, status: str) -> float:
    """mrc_jobs_total of this outcome: the jobs whose end was counted so far."""
    return sum(
        sample.value
        for metric in pipeline.metrics.registry.collect()
        if metric.name == "mrc_jobs"
        for sample in metric.samples
        if sample.name == "mrc_jobs_total" and sample.labels["status"] == status
    )


def test_prompts_are_truncated_and_recorded(store: MemoryStore) -> None:
    _pipeline(store, max_prompt_tokens=3).run([_job("long", prompt="one two three four five")])
    result = store.get_result("long")
    assert result["prompt"] == {"chars": 23, "tokens": 3, "truncated": True, "original_tokens": 5}
    _pipeline(store, max_prompt_tokens=3, truncate_prompts=False).run(
        [_job("long2", prompt="one two three four")]
    )
    assert store.get_result("long2")["error"]["code"] == "prompt_too_long"
    # A job that asks not to be cut (a folded conversation) fails where the worker would truncate.
    _pipeline(store, max_prompt_tokens=3).run([_job("long3", prompt="one two three four", truncate=False)])
    assert store.get_result("long3")["error"]["code"] == "prompt_too_long"
    # What it had is said (review: 0 and 0 beside "prompt has 4 tokens"); the model saw none of it.
    assert store.get_result("long3")["prompt"] == {
        "chars": 18,
        "tokens": 0,
        "truncated": False,
        "original_tokens": 4,
    }


def test_a_job_that_expires_while_answered_ends_expired_and_bills_no_answer(store: MemoryStore) -> None:
    """Review: a job past its deadline mid-decode ran to its end; then, expired there, its result billed
    the completion tokens of an answer it never handed out."""
    pipeline = _pipeline(store, EchoBackend(token_s=0.5))  # 8 tokens: 4 s
    deadline = (datetime.now(UTC) + timedelta(seconds=2)).isoformat().replace("+00:00", "Z")
    assert pipeline.run([_job("late", prompt=" ".join(["word"] * 20), deadline=deadline)]) == ["failed"]
    result = store.get_result("late")
    assert result["error"]["code"] == "expired"
    assert result["usage"]["prompt_tokens"] > 0
    assert result["usage"]["completion_tokens"] == 0


def test_over_limit_max_new_tokens_is_invalid(store: MemoryStore) -> None:
    _pipeline(store).run([_job("greedy", max_new_tokens=100_000)])
    assert store.get_result("greedy")["error"]["code"] == "invalid_job"


def test_a_succeeded_job_delivered_again_is_not_recomputed(store: MemoryStore) -> None:
    backend = EchoBackend()
    pipeline = _pipeline(store, backend)
    assert pipeline.run([_job("once")]) == ["succeeded"]
    assert pipeline.run([_job("once")]) == ["skipped"]
    assert len(backend.prefills) == 1


def test_a_result_stored_by_a_worker_that_died_before_its_record_is_not_computed_again(
    store: MemoryStore,
) -> None:
    """Review (helper-48): a worker killed between writing a job's result and its record left the
    record `running` (the producer had checked it, `checked=1`); the next delivery took it for a
    suspect, computed it again and overwrote the result (attempts 1 -> 2, a new finished_at). Its
    stored result is found, it is skipped, and its record says succeeded."""
    records, backend = MemoryJobRecords(), EchoBackend()
    token = records.claim("half-done", "interactive", "")
    assert token is not None
    records.confirm("half-done", token, checked=True)  # as the producer leaves it
    pipeline = _pipeline(store, backend, records)
    assert pipeline.run([_job("half-done")]) == ["succeeded"]
    stored = store.get_result("half-done")
    # What the kill lost: the record's update, and the usage and the event that come after it.
    records.records["half-done"] = {**records.get("half-done"), "state": "running"}
    records.records["half-done"].pop("usage_counted")
    events_before = len(records.events)
    assert pipeline.run([_job("half-done")]) == ["skipped"]
    assert store.get_result("half-done") == stored
    assert len(backend.prefills) == 1
    assert records.get("half-done")["state"] == "succeeded"
    assert records.get("half-done")["usage_counted"] == "1"  # counted once, as its own end would have
    assert [(e["job_id"], e["status"]) for e in records.events[events_before:]] == [
        ("half-done", "succeeded")
    ]


def test_a_job_whose_worker_died_between_its_record_and_its_count_is_counted_on_its_redelivery(
    store: MemoryStore,
) -> None:
    """Review, helper-93: a kill -9 after the record said `succeeded` and before the usage count left
    the job uncounted for good: the redelivery skipped it (`already_succeeded`) without settling, its
    run's finished count stayed one short and the ops page showed the run running for ever."""
    records, backend = MemoryJobRecords(), EchoBackend()
    pipeline = _pipeline(store, backend, records)
    assert pipeline.run([_job("counted-late")]) == ["succeeded"]
    records.records["counted-late"].pop("usage_counted")  # what the kill lost: the count, the event
    events_before = len(records.events)
    assert pipeline.run([_job("counted-late")]) == ["skipped"]
    assert len(backend.prefills) == 1
    assert records.get("counted-late")["usage_counted"] == "1"
    assert [(e["job_id"], e["status"]) for e in records.events[events_before:]] == [
        ("counted-late", "succeeded")
    ]
    assert pipeline.run([_job("counted-late")]) == ["skipped"]  # counted: nothing more to settle
    assert len(records.events) == events_before + 1


def test_a_stored_result_is_found_after_a_retry_and_a_settle_that_fails_gives_the_delivery_back(
    store: MemoryStore,
) -> None:
    """Review (helper-51): a job sent back for a retry (its record `queued` again, still `checked`)
    after its result was stored was computed again and its result overwritten: the next delivery
    skipped the look at S3. And a settle whose record write failed was swallowed: the delivery was
    acked with the record `running` for good. The look is made; the failure is raised."""
    records, backend = MemoryJobRecords(), EchoBackend()
    token = records.claim("retried", "interactive", "")
    assert token is not None
    records.confirm("retried", token, checked=True)
    pipeline = _pipeline(store, backend, records)
    assert pipeline.run([_job("retried")]) == ["succeeded"]
    records.records["retried"] = {
        **records.get("retried"),
        "state": "queued",
        "retry_reason": "internal_error",
    }
    assert pipeline.run([_job("retried")]) == ["skipped"]
    assert len(backend.prefills) == 1
    assert records.get("retried")["state"] == "succeeded"

    class Flaky(MemoryJobRecords):
        def set_state(self, job_id: str, state: Any, **fields: str) -> None:
            if state == "succeeded" and not fields:
                raise ConnectionError("Redis is restarting")
            super().set_state(job_id, state, **fields)

    flaky = Flaky()
    flaky.records["retried"] = {**records.get("retried"), "state": "running"}
    with pytest.raises(ConnectionError):  # not acked as skipped: it comes back, and is settled then
        _pipeline(store, backend, flaky).run([_job("retried")])
    assert flaky.get("retried")["state"] == "running"


def test_a_failed_job_delivered_again_keeps_its_one_result_until_requeued(store: MemoryStore) -> None:
    """An outside review's finding: a job that failed for its input wrote its result at once, while its
    delivery went on (a neighbour's lone run); a worker killed then sent it round again, and it failed
    and was written a second time (contract: a result is written once per outcome). Delivered again it
    is skipped; requeued (`mrc dlq requeue`, or submitted again) it runs again."""
    records = MemoryJobRecords()
    pipeline = _pipeline(store, records=records)
    bad = [_job("bad", image="s3://mrc/inputs/bad.jpg"), _job("too-long", prompt="x " * 900, truncate=False)]
    try:
        assert pipeline.run(bad) == ["failed", "failed"]
        first = {job.request_id: store.get_result(job.request_id) for job in bad}
        assert pipeline.run(bad) == ["skipped", "skipped"]  # the delivery given back unacked, again
        assert {job.request_id: store.get_result(job.request_id) for job in bad} == first
        records.reset_attempts("bad", "push-2")  # requeued: it runs again, its new outcome written
        assert pipeline.run(bad[:1]) == ["failed"]
        assert store.get_result("bad")["attempts"] == 1
    finally:
        pipeline.close()


def test_result_that_cannot_be_stored_is_reported_unwritten(store: MemoryStore) -> None:
    class DownStore(MemoryStore):
        def put_result(self, job_id: str, result: dict[str, Any]) -> str:
            raise StoreUnavailable("S3 down")

    down = DownStore("mrc")
    down.objects = dict(store.objects)
    records, requeued = MemoryJobRecords(), Requeued()
    # Within MRC_STORE_OUTAGE_S the outage is waited out, however many retries it takes (review,
    # helper-93: the second counted attempt dead-lettered it with no result stored).
    waiting = _pipeline(down, records=records, requeue=requeued, max_attempts=2)
    assert [waiting.run([_job("lost-1")]) for _ in range(4)] == [["retry"]] * 4
    assert not records.dlq
    # A long outage's retries are many: the delay's doubling stops before it overflows (review,
    # helper-94: the 1,025th retry raised OverflowError and the worker exited 70, again and again).
    records.records["lost-1"]["store_retries"] = "5000"
    assert waiting.run([_job("lost-1")]) == ["retry"]
    # Past it (a fault that never clears) the retries count: the last attempt fails unwritten.
    spent = _pipeline(down, records=records, requeue=requeued, max_attempts=2, store_outage_s=0)
    assert spent.run([_job("lost-1")]) == ["retry"]
    assert spent.run([_job("lost-1")]) == ["unwritten"]
    assert len(requeued) == 6
    assert [e["job_id"] for e in records.dlq] == ["lost-1"]


def test_attempts_count_deliveries(store: MemoryStore) -> None:
    records = MemoryJobRecords()
    pipeline = _pipeline(store, EchoBackend(fail_on="x"), records)
    records.begin("retry")  # a first delivery whose worker died with it in hand
    pipeline.run([_job("retry", prompt="x")])
    assert store.get_result("retry")["attempts"] == 2


def test_lane_default_deadline_expires_old_jobs(store: MemoryStore) -> None:
    pipeline = _pipeline(store, deadline_backlog_s=60)
    old = _job("old-backlog", lane="backlog", submitted_at="2000-01-01T00:00:00Z")
    fresh = _job("fresh-backlog", lane="backlog")
    old_interactive = _job("old-interactive", submitted_at="2000-01-01T00:00:00Z")
    assert pipeline.run([old, fresh, old_interactive]) == ["failed", "succeeded", "succeeded"]
    assert store.get_result("old-backlog")["error"]["code"] == "expired"


def _crashed(records: MemoryJobRecords, *job_ids: str, solo_runs: int = 0) -> None:
    """As a worker that died mid-batch leaves them: begun, running, never finished."""
    for job_id in job_ids:
        records.begin(job_id)
        for _ in range(solo_runs):
            records.solo_run(job_id)


def test_jobs_of_a_crashed_delivery_run_in_halves_after_the_others(store: MemoryStore) -> None:
    records, backend = MemoryJobRecords(), EchoBackend()
    _crashed(records, "c1", "c2", "c3")
    messages = [_job("c1"), _job("fresh-1"), _job("c2"), _job("fresh-2"), _job("c3")]
    outcomes = _pipeline(store, backend, records).run(messages)
    assert outcomes == ["succeeded"] * 5
    # the fresh pair first, then the suspects in halves, each apart: c1 and c2 together, c3 alone
    assert backend.prefills == ["refund?"] * 5
    assert records.get("fresh-1")["state"] == "succeeded"
    assert [records.get(j)["suspect_group"] for j in ("c1", "c2", "c3")] == ["2", "2", "1"]
    # c3's lone run was counted as it began and withdrawn as it ended: it counts runs a worker died in
    assert [records.get(j).get("solo_runs") for j in ("c1", "c2", "c3")] == [None, None, "0"]


def test_only_the_job_that_keeps_killing_workers_is_abandoned(store: MemoryStore) -> None:
    records = MemoryJobRecords()
    _crashed(records, "killer", solo_runs=2)  # it was running alone when the last two workers died
    _crashed(records, "neighbour")  # in the same delivery, never alone
    outcomes = _pipeline(store, records=records, max_attempts=3).run([_job("killer"), _job("neighbour")])
    assert outcomes == ["failed", "succeeded"]
    error = store.get_result("killer")["error"]
    assert error["code"] == "internal_error"
    assert "abandoned" in error["message"]
    assert [e["job_id"] for e in records.dlq] == ["killer"]  # `mrc dlq requeue` can bring it back


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"),
        RuntimeError("CUDA error: device-side assert triggered"),
    ],
)
def test_a_broken_device_ends_the_worker_instead_of_failing_jobs(
    store: MemoryStore, error: Exception
) -> None:
    from shared.errors import WorkerUnusable

    backend = EchoBackend(fail_on="refund", error=error)  # every call fails: the context is gone
    with pytest.raises(WorkerUnusable):
        _pipeline(store, backend).run([_job(f"d{i}") for i in range(4)])
    assert len(backend.prefill_calls) == 1  # one call, no per-job retries: the fault ends the worker
    assert not [k for (_b, k) in store.objects if k.startswith("results/")]


def test_a_delivery_a_broken_device_gives_back_leaves_no_retry_copy_and_no_failure_written(
    store: MemoryStore,
) -> None:
    """Found by review of c6d1c36: failures settled before the model were written (and a retryable one
    requeued with a countdown) while the delivery ran; a device fault then gives the whole delivery back
    unacked, so the retried job was queued twice (it ran twice) and the failed one was announced again
    by its redelivery. Only an answer from the cache is written early: its redelivery is skipped."""
    from shared.errors import WorkerUnusable
    from workers.memory_cache import MemoryResultCache

    class FlakyStore(MemoryStore):
        def get_bytes(self, bucket: str, key: str, max_bytes: int) -> bytes | None:
            if key == "inputs/flaky.jpg":
                raise StoreUnavailable("S3 503 SlowDown")  # a retryable fetch failure
            return super().get_bytes(bucket, key, max_bytes)

    class SlowEvents(MemoryJobRecords):
        def add_event(self, event: dict[str, str], keep: int) -> str:
            time.sleep(0.3)  # a busy machine: the cached answer's end is still being written (a CI run)
            return super().add_event(event, keep)

    flaky = FlakyStore("mrc")
    flaky.objects.update(store.objects)
    flaky.put_bytes("inputs/flaky.jpg", imagegen.photo(64, 48), "image/jpeg")
    records, requeued, cache = SlowEvents(), Requeued(), MemoryResultCache()
    healthy = assemble(EchoBackend(), flaky, flaky, records, Settings(), sleep=lambda _s: None, cache=cache)
    try:
        assert healthy.run([_job("asked-before", prompt="colour?")]) == ["succeeded"]
    finally:
        healthy.close()
    broken = EchoBackend(fail_on="refund", error=RuntimeError("CUDA error: an illegal memory access"))
    dying = assemble(broken, flaky, flaky, records, Settings(), sleep=lambda _s: None, cache=cache,
                     requeue=requeued)  # fmt: skip
    delivery = [
        _job("d0"),
        _job("flaky", image="s3://mrc/inputs/flaky.jpg"),
        _job("missing", image="s3://mrc/inputs/nope.jpg"),
        _job("cached", prompt="colour?"),
    ]
    try:
        with pytest.raises(WorkerUnusable):
            dying.run(delivery)
    finally:
        dying.close()
    assert not requeued

    def written() -> set[str]:
        keys = [key for (_bucket, key) in flaky.objects if key.startswith("results/")]
        return {key.removeprefix("results/").removesuffix(".json") for key in keys}

    # The cached answer's end may still be being written as the fault ends the delivery (a worker
    # exits then: its redelivery finds the result and settles the rest, below): looked at until done.
    deadline = time.monotonic() + 30
    while len(records.events) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert written() == {"asked-before", "cached"}
    assert [e["job_id"] for e in records.events] == ["asked-before", "cached"]
    again = assemble(EchoBackend(), flaky, flaky, records, Settings(), sleep=lambda _s: None, cache=cache,
                     requeue=Requeued())  # fmt: skip
    try:  # the given-back delivery on the next worker: the cached answer is not announced twice
        outcomes = again.run(delivery)
    finally:
        again.close()
    assert outcomes[3] == "skipped"
    assert sorted(e["job_id"] for e in records.events).count("cached") == 1


def test_accelerator_errors_are_fatal_by_type() -> None:
    import torch

    from shared.errors import WorkerUnusable
    from workers import inference

    with pytest.raises(WorkerUnusable):
        inference.classify(torch.AcceleratorError("CUDA-capable device(s) is/are busy or unavailable"))
    assert inference.classify(torch.cuda.OutOfMemoryError("CUDA out of memory")).code == "out_of_memory"
    assert inference.classify(ValueError("shapes do not match")).code == "model_error"


def test_a_model_that_fails_every_job_in_a_row_makes_the_worker_unusable(store: MemoryStore) -> None:
    from shared.errors import WorkerUnusable

    backend = EchoBackend(fail_on="refund")  # every job asks about a refund: every call fails
    with pytest.raises(WorkerUnusable, match="in a row"):
        _pipeline(store, backend, model_failure_streak=5).run([_job(f"m{i}") for i in range(8)])
    assert not [k for (_b, k) in store.objects if k.startswith("results/")]


def test_a_different_job_under_a_used_id_never_overwrites_its_result(store: MemoryStore) -> None:
    backend = EchoBackend()
    assert _pipeline(store, backend).run([_job("used", prompt="first question")]) == ["succeeded"]
    first = store.get_result("used")
    # The record expired (a week later), then another job arrived under the same id.
    assert _pipeline(store, backend).run([_job("used", prompt="another question")]) == ["skipped"]
    assert store.get_result("used") == first
    assert len(backend.prefills) == 1
    # The same job again after expiry: already done, not recomputed.
    assert _pipeline(store, backend).run([_job("used", prompt="first question")]) == ["skipped"]


def test_an_invalid_message_never_overwrites_a_result(store: MemoryStore) -> None:
    assert _pipeline(store).run([_job("precious")]) == ["succeeded"]
    before = store.get_result("precious")
    assert _pipeline(store).run([Message("precious", {"broken": True})]) == ["skipped"]
    assert store.get_result("precious") == before


def test_the_result_reports_the_hash_of_the_bytes_used(store: MemoryStore) -> None:
    import hashlib

    _pipeline(store).run([_job("hashed", image_sha256="0" * 64)])
    data = store.get_bytes("mrc", "inputs/good.jpg", 1 << 20)
    assert store.get_result("hashed")["image"]["sha256"] == hashlib.sha256(data or b"").hexdigest()


def test_redis_gone_during_claim_raises_instead_of_failing_the_jobs(store: MemoryStore) -> None:
    class Down(MemoryJobRecords):
        def begin(self, job_id: str) -> int:
            raise ConnectionError("Redis is restarting")

    with pytest.raises(ConnectionError):
        _pipeline(store, records=Down()).run([_job("keep-me")])
    assert store.get_result("keep-me") is None  # no permanent failed result for a transient outage


def test_a_failed_write_is_raised_after_its_neighbours_writes_end(store: MemoryStore) -> None:
    """The first write that failed was raised at once, the worker then exiting with its neighbours'
    writes in flight, cut off half done (a result stored, its record still `running`)."""

    failed: list[str] = []

    class Slow(MemoryJobRecords):
        def set_state(self, job_id: str, state: Any, **fields: str) -> None:
            if state != "running" and not failed:  # the first write to end fails
                failed.append(job_id)
                raise ConnectionError("Redis is restarting")
            if state != "running":
                time.sleep(0.3)
            super().set_state(job_id, state, **fields)

    records = Slow()
    with pytest.raises(ConnectionError):
        # One writer thread: the writes run in the order they were sent off, the first failing.
        _pipeline(store, records=records, fetch_threads=1).run([_job("one"), _job("two"), _job("three")])
    assert [records.get(j)["state"] for j in ("one", "two", "three") if j not in failed] == [
        "succeeded",
        "succeeded",
    ]


def test_a_cache_that_is_down_is_a_miss(store: MemoryStore) -> None:
    from workers.memory_cache import MemoryResultCache

    class DownCache(MemoryResultCache):
        def get(self, key: str) -> dict[str, Any] | None:
            raise ConnectionError("cache down")

    pipeline = assemble(
        EchoBackend(), store, store, MemoryJobRecords(), Settings(), sleep=lambda _s: None, cache=DownCache()
    )
    assert pipeline.run([_job("uncached")]) == ["succeeded"]


def test_two_copies_of_a_job_in_one_delivery_run_once(store: MemoryStore) -> None:
    backend = EchoBackend()
    assert _pipeline(store, backend).run([_job("twice"), _job("twice")]) == ["succeeded", "skipped"]
    assert len(backend.prefills) == 1


def test_a_result_check_that_meets_an_s3_outage_is_retried_and_counted(store: MemoryStore) -> None:
    class Down(MemoryStore):
        def get_result(self, job_id: str) -> dict[str, Any] | None:
            raise StoreUnavailable("S3 down")

    down = Down("mrc")
    down.objects = dict(store.objects)
    records, requeued = MemoryJobRecords(), Requeued()
    waiting = _pipeline(down, records=records, requeue=requeued, max_attempts=2)
    assert waiting.run([_job("unchecked")]) == ["retry"]  # no record: the worker must look first
    assert records.get("unchecked")["attempts"] == "0"  # S3 away: the attempt given back
    pipeline = _pipeline(down, records=records, requeue=requeued, max_attempts=2, store_outage_s=0)
    assert pipeline.run([_job("unchecked")]) == ["retry"]  # past MRC_STORE_OUTAGE_S: counted
    assert records.get("unchecked")["attempts"] == "1"
    assert pipeline.run([_job("unchecked")]) == ["failed"]  # the budget ends; never run blind
    assert [e["job_id"] for e in records.dlq] == ["unchecked"]
    # A job whose record says it succeeded (its ack lost) is done, S3 away or not: not retried, not
    # failed over its success at its last attempt, so never counted twice once requeued (review).
    assert _pipeline(store, records=records).run([_job("done")]) == ["succeeded"]
    counted = dict(records.get("done"))
    assert _pipeline(down, records=records, requeue=requeued, max_attempts=1).run([_job("done")]) == [
        "skipped"
    ]
    assert records.get("done") == counted
    assert "done" not in [e["job_id"] for e in records.dlq]


def test_failures_beside_a_success_do_not_count_towards_the_streak(store: MemoryStore) -> None:
    backend = EchoBackend(fail_on="POISON")
    messages = [_job(f"p{i}", prompt="POISON") for i in range(6)] + [_job("fine")]
    outcomes = _pipeline(store, backend, model_failure_streak=5).run(messages)
    assert outcomes == ["failed"] * 6 + ["succeeded"]  # the model works; six jobs broke it


def test_a_model_that_fails_every_job_of_deliveries_in_a_row_ends_the_worker(store: MemoryStore) -> None:
    from shared.errors import WorkerUnusable

    pipeline = _pipeline(store, EchoBackend(fail_on="POISON"), model_failure_streak=5)
    assert pipeline.run([_job(f"q{i}", prompt="POISON") for i in range(3)]) == ["failed"] * 3
    with pytest.raises(WorkerUnusable):
        pipeline.run([_job(f"r{i}", prompt="POISON") for i in range(3)])


def test_each_result_says_which_attention_path_it_took(store: MemoryStore) -> None:
    """causal: every attention call of the row read its own positions only (its prefill always does;
    the echo model's steps read no padding); masked: a decode step read padding under a mask (the
    fixed-shape step: tests/unit/test_engine_failures.py checks a real runner's padding)."""
    _pipeline(store).run([_job("alone-1")])
    assert store.get_result("alone-1")["model"]["attention_path"] == "causal"
    store.put_bytes("inputs/wide.jpg", imagegen.photo(300, 48), "image/jpeg")
    paced = EchoBackend(token_s=0.05)  # 8 steps of 50 ms: the second row joins while the first decodes
    _pipeline(store, paced).run([_job("mx-1"), _job("mx-2", image="s3://mrc/inputs/wide.jpg")])
    assert {store.get_result(j)["model"]["attention_path"] for j in ("mx-1", "mx-2")} == {"causal"}


def test_every_result_carries_its_usage_counted_once_per_key(store: MemoryStore) -> None:
    """usage: the row's prompt positions (64x48 image: 2 patch rows of 3 + a newline = 8; the echo
    model's one word each) and its generated tokens; a cache hit reports the answer it reuses, a job
    the model never took reports zeros; the key's totals count each job once."""
    from workers.memory_cache import MemoryResultCache

    records = MemoryJobRecords()
    pipeline = assemble(
        EchoBackend(), store, store, records, Settings(), sleep=lambda _s: None, cache=MemoryResultCache()
    )
    key = "0123456789ab"
    jobs = [_job("u1", api_key=key), _job("u-missing", image="s3://mrc/inputs/nope.jpg", api_key=key)]
    assert pipeline.run(jobs) == ["succeeded", "failed"]
    assert pipeline.run([_job("u2", api_key=key), _job("u1", api_key=key)]) == ["succeeded", "skipped"]
    answered = {
        "prompt_tokens": 9, "image_tokens": 8, "completion_tokens": 2, "total_tokens": 11, "cached_tokens": 0,
    }  # fmt: skip
    assert store.get_result("u1")["usage"] == answered  # "64x48: refund?": two tokens
    assert store.get_result("u2")["cache_hit"] is True
    assert store.get_result("u2")["usage"] == {**answered, "cached_tokens": 9}  # a reused answer: all of it
    assert store.get_result("u-missing")["usage"] == dict.fromkeys(answered, 0)
    totals = records.usage[key]
    assert (totals["jobs"], totals["prompt_tokens"], totals["completion_tokens"]) == (3, 18, 4)
    assert totals["cache_hits"] == 1
    assert records.get("u1")["usage_prompt"] == "9"
    assert not records.count_usage("u1", key, answered, False)  # a result written again: not counted


def test_the_echo_model_gets_the_rows_the_settings_give_a_model(store: MemoryStore) -> None:
    """The cache's slots are capped by MRC_BATCH_TOKEN_BUDGET / slot positions: a backend whose slot
    claimed every position it could ever hold ran one row at a time (the lanes fault test's backlog
    of 120 answers took 13 minutes instead of 20 s)."""
    for wanted in (Settings().model_batch_max_jobs, 4):
        pipeline = _pipeline(store, model_batch_max_jobs=wanted)
        try:
            assert pipeline.describe()["engine_slots"] == wanted
        finally:
            pipeline.close()


def test_a_job_past_this_workers_limits_fails_under_its_own_id(store: MemoryStore) -> None:
    """A producer whose limits are higher than this worker's (mid-rollout): the job failed under the
    message's task id, and the job the caller waited on stayed queued with no result, ever. So did a
    malformed job whose message carries its id."""
    image = "s3://mrc/inputs/good.jpg"
    over = {"job_id": "chat-over", "image_uri": image, "prompt": "q", "max_new_tokens": 40}
    malformed = {"job_id": "chat-malformed", "image_uri": image, "prompt": "q", "pad": 1}
    messages = [Message("celery task 1", over), Message("celery task 2", malformed), _job("fine")]
    records = MemoryJobRecords()
    pipeline = _pipeline(store, records=records, max_new_tokens_limit=16, max_new_tokens_default=8)
    assert pipeline.run(messages) == ["failed", "failed", "succeeded"]
    error = store.get_result("chat-over")["error"]
    assert (error["code"], "max_new_tokens" in error["message"]) == ("invalid_job", True)
    assert store.get_result("chat-malformed")["error"]["code"] == "invalid_job"
    assert not [k for (_b, k) in store.objects if k.startswith("results/invalid-")]


def test_a_photos_questions_decode_it_once_per_key(store: MemoryStore) -> None:
    """Several questions of one photo (the backlog's of a complaint): each job fetches it, one decode
    serves them all while it is kept; another key's job of the same bytes decodes its own."""
    alice, bob = "a" * 12, "b" * 12
    pipeline = _pipeline(store)
    try:
        jobs = [_job(f"{alice}~q{i}", prompt=f"question {i}?", api_key=alice) for i in range(3)]
        assert pipeline.run([*jobs, _job(f"{bob}~q0", api_key=bob)]) == ["succeeded"] * 4
        assert pipeline.run([_job(f"{alice}~later", prompt="and now?", api_key=alice)]) == ["succeeded"]
        count = pipeline.metrics.registry.get_sample_value
        assert count("mrc_image_decodes_total", {"result": "decoded"}) == 2
        assert count("mrc_image_decodes_total", {"result": "reused"}) == 3
        assert count("mrc_decoded_images_held_bytes") == 2 * 3 * 64 * 48
        for job_id in (f"{alice}~q0", f"{alice}~q2", f"{alice}~later", f"{bob}~q0"):
            assert store.get_result(job_id)["text"].startswith("64x48"), job_id
    finally:
        pipeline.close()


def test_a_deliverys_looks_for_earlier_results_are_asked_at_once(
    store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog job's record says it was not checked (a bulk enqueue asks S3 nothing per line), so the
    worker looks for an earlier result before it runs it: one after another, a delivery of 16 waited
    16 round trips of a real S3 (~20 ms each) before any of its rows could start. The looks now wait
    at a barrier no look passes until eight are in flight at once; one after another, it broke."""
    import threading

    records = MemoryJobRecords()
    store.put_result("done-3", {"status": "succeeded", "job_id": "done-3", "text": "earlier"})
    jobs = [_job(f"done-{n}") for n in range(8)]
    together = threading.Barrier(len(jobs), timeout=30)
    real_get_result = store.get_result

    def get_result(job_id: str) -> dict[str, Any] | None:
        if job_id.startswith("done-"):
            together.wait()
        return real_get_result(job_id)

    monkeypatch.setattr(store, "get_result", get_result)
    backend = EchoBackend()
    outcomes = _pipeline(store, backend, records).run(jobs)
    assert outcomes == ["succeeded"] * 3 + ["skipped"] + ["succeeded"] * 4
    assert real_get_result("done-3")["text"] == "earlier"  # skipped: never computed again
    assert len(backend.prefills) == 7


@pytest.mark.parametrize("round_trip", ["image fetch", "result write"])
def test_a_deliverys_images_and_results_go_to_s3_at_once(
    store: MemoryStore, monkeypatch: pytest.MonkeyPatch, round_trip: str
) -> None:
    """Review, helper-120, at 25 ms of S3 latency: a delivery's images were fetched, and its results
    written, four at a time (the decode threads' number), so a delivery of 16 waited four rounds of
    S3 for its images and four more for its results (images 146-275 ms, results 218-465 ms a delivery).
    Each round trip now waits at a barrier no call passes until eight are in flight at once."""
    import threading

    jobs = [_job(f"{round_trip[:5]}-{n}", image=f"s3://mrc/inputs/p{n}.jpg") for n in range(8)]
    for n in range(8):
        store.put_bytes(f"inputs/p{n}.jpg", imagegen.photo(64, 48, seed=n), "image/jpeg")
    together = threading.Barrier(len(jobs), timeout=30)
    if round_trip == "image fetch":
        real_get = store.get_bytes

        def get_bytes(bucket: str, key: str, max_bytes: int) -> bytes | None:
            if key.startswith("inputs/p"):
                together.wait()
            return real_get(bucket, key, max_bytes)

        monkeypatch.setattr(store, "get_bytes", get_bytes)
    else:
        real_put = store.put_result

        def put_result(job_id: str, result: dict[str, Any]) -> str:
            together.wait()
            return real_put(job_id, result)

        monkeypatch.setattr(store, "put_result", put_result)
    outcomes = _pipeline(store, EchoBackend(), fetch_threads=4, batch_max_jobs=8).run(jobs)
    assert outcomes == ["succeeded"] * len(jobs)


def test_a_tickets_looks_never_wait_behind_a_backlog_deliverys(
    store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, helper-121: the looks for earlier results went through one pool of 16 for both lanes, so
    a ticket's delivery waited for a backlog delivery's sixteen looks (each a round trip of S3's). A
    backlog delivery's looks here hang until the ticket's delivery has finished, or a minute passed."""
    import threading

    records = MemoryJobRecords()
    backlog = [_job(f"bk-{n}", lane="backlog") for n in range(16)]
    tickets = [_job(f"tk-{n}") for n in range(2)]
    for message in (*backlog, *tickets):  # as left unchecked: each is looked for before it runs
        records.records[message.request_id] = {"state": "queued", "published": "1", "checked": "0"}
    release, hanging = threading.Event(), threading.Semaphore(0)
    real_get_result = store.get_result

    def get_result(job_id: str) -> dict[str, Any] | None:
        if job_id.startswith("bk-"):
            hanging.release()
            release.wait(60)
        return real_get_result(job_id)

    monkeypatch.setattr(store, "get_result", get_result)
    pipeline = _pipeline(store, EchoBackend(), records)
    given_up = threading.Timer(60, release.set)
    given_up.start()
    backlog_outcomes: list[str] = []
    behind = threading.Thread(target=lambda: backlog_outcomes.extend(pipeline.run(backlog)))
    behind.start()
    try:
        for _ in backlog:
            assert hanging.acquire(timeout=60), "the backlog's looks never began"
        assert pipeline.run(tickets) == ["succeeded"] * 2
        assert not release.is_set(), "the ticket's looks waited for the backlog's"
    finally:
        release.set()
        given_up.cancel()
        behind.join(60)
    assert backlog_outcomes == ["succeeded"] * 16


def test_a_workers_s3_calls_at_once_stay_within_its_client_pool() -> None:
    """Review, helper-121: the fetch and write pools took MRC_BATCH_MAX_JOBS threads whatever it was,
    past the S3 client's 64 connections ("Connection pool is full": a new handshake a call). They take
    S3_CALLS_A_LANE at most, and every pool of S3 calls a worker has fits the client's pool."""
    from shared.stores.s3 import MAX_S3_CONNECTIONS
    from workers.admission import LOOKS_AT_ONCE
    from workers.pipeline import S3_CALLS_A_LANE

    store = MemoryStore("mrc")
    pipeline = _pipeline(store, batch_max_jobs=128, fetch_threads=4)
    try:
        for pools in (pipeline._fetches, pipeline._writes):
            assert {pool._max_workers for pool in pools.pools.values()} == {S3_CALLS_A_LANE}
    finally:
        pipeline.close()
    lanes, decodes = 2, Settings().fetch_threads  # a decode's re-fetch of a photo let go
    assert lanes * (2 * S3_CALLS_A_LANE + LOOKS_AT_ONCE + decodes) <= MAX_S3_CONNECTIONS
